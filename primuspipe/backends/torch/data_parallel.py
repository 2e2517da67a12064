"""Data parallelism around a pipeline stage: what DDP and FSDP2 need from a step of many microbatches.

A stage module may be wrapped in ``DistributedDataParallel`` or ``fully_shard`` (FSDP2), as with
torch.distributed.pipelining. Gradients of all microbatches accumulate locally and are reduced across
replicas once per step, after the stage's last weight gradient (where torch's schedules run
``REDUCE_GRAD``, :mod:`primuspipe.ir.resources`), then divided by the microbatch count when scaling:

* DDP: forwards and backwards run under ``no_sync()``, except the part that completes the stage's last
  weight gradient (its last ``BW`` or ``W``), which runs with synchronisation on after
  ``reducer.prepare_for_backward`` (the reducer was not prepared by a forward, which ran under
  ``no_sync``), so DDP's own hooks all-reduce the accumulated gradients.
  ``find_unused_parameters=True`` cannot be honoured by a ``W`` (its restart starts below the stage
  outputs DDP would search from) and is refused for tables with ``W`` nodes.
* FSDP2: every backward runs with gradient sync, ``is_last_backward`` and resharding after backward
  off; at the reduction the flags go back on and each FSDP state's parameter groups run their
  post-backward (the reduce-scatter), as torch.distributed.pipelining does. A split backward needs
  this: FSDP's own post-backward hook fires when the gradient reaches the module inputs, which is in
  ``B``, before ``W`` has produced the weight gradients. ``UNSHARD``/``RESHARD`` of the resource plan
  all-gather and free the stage's parameters around the nodes that use them.
* Anything else: plain accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from primuspipe.errors import ConfigError


def check_wrappers(modules: list[torch.nn.Module], split_backward: bool) -> None:
    """Refuse what a table's nodes cannot honour (see the module docstring)."""
    for module in modules:
        if split_backward and isinstance(module, DistributedDataParallel) and module.find_unused_parameters:
            raise ConfigError("a DDP stage with find_unused_parameters=True cannot run a table with W nodes (split "
                              "backward); build DDP with find_unused_parameters=False or pick a schedule with a "
                              "fused backward (1f1b, interleaved-1f1b)")


def forward_context(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Around a forward: no DDP reduction (gradients accumulate until the stage's last backward)."""
    if isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def backward_context(module: torch.nn.Module, last: bool) -> Iterator[None]:
    """Around a backward part; ``last``: it completes the stage's last weight gradient of the step."""
    if isinstance(module, DistributedDataParallel):
        if last:
            module.reducer.prepare_for_backward([])
            yield
        else:
            with module.no_sync():
                yield
        return
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)
    yield


def reduce_gradients(module: torch.nn.Module) -> None:
    """The end-of-step reduction of an FSDP2 stage (DDP reduced in its last backward)."""
    if not isinstance(module, FSDPModule):
        return
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for each in state._state_ctx.all_states:
        for param_group in each._fsdp_param_groups:
            param_group.post_backward()
    state._root_post_backward_final_callback()


def unshard(module: torch.nn.Module) -> None:
    for sub in fsdp_modules(module):
        sub.unshard()


def reshard(module: torch.nn.Module) -> None:
    for sub in fsdp_modules(module):
        sub.reshard()


def fsdp_modules(module: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2-sharded modules in ``module`` (itself included)."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def scale_gradients(module: torch.nn.Module, factor: int) -> None:
    """Divide the stage's gradients by ``factor`` (torch's ``scale_grads``: the microbatch count)."""
    if factor != 1:
        for p in module.parameters():
            if p.grad is not None:
                p.grad.div_(factor)
