"""Megatron's coalesced parameter all-gather, issued one request at a time on gloo (part of CPU mode).

Megatron's DDP buffers gather each bucket group's parameters inside ``torch.distributed._coalescing_manager``
(``start_param_sync``; asynchronous under ``overlap_param_gather``). torch 2.13 hands such a block to the
backend as one fused request, ``all_gather_single_coalesced``, and gloo's fused all-gather corrupts the
process's heap. Measured on this project's 2-core host, 4 ranks each issuing 20,000 blocks of one gather:
asynchronous blocks on one-rank groups lost a rank to SIGSEGV or glibc's SIGABRT in 4 of 6 launches, on
two-rank groups in 1 of 6, synchronous blocks on one-rank groups in 1 of 6; the same gathers issued one by
one, and gloo's fused reduce-scatter and all-reduce, ran 6 of 6 launches each without a fault; through this
module's manager 8 of 8 (``tests/megatron/test_gloo_all_gather.py`` runs the pattern). In a Megatron step
on CPU it surfaced as a rank killed inside a later collective while a gather ran on gloo's worker thread.

:func:`coalescing_manager` is torch's manager with one change: on a gloo group, a block of captured
all-gathers is issued request by request, and the manager's handle waits for all of them (a synchronous
block waits for each) -- what torch does on backends without a fused form. An all-gather only copies, so
the bytes are those of the fused request; every other block (reduce-scatter, all-reduce, any other backend,
the NCCL emulator, which already issues gathers pair by pair) goes to torch unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d


@contextlib.contextmanager
def coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[Any]:
    """``torch.distributed._coalescing_manager`` with a gloo group's all-gathers issued one by one."""
    with dist._coalescing_manager(group, device, async_ops) as manager:
        yield manager
        group = group if group is not None else distributed_c10d._get_default_group()
        captured = distributed_c10d._world.pg_coalesce_state
        requests = captured.get(group) or []
        if dist.get_backend(group) != "gloo" or not all(r.op is distributed_c10d.all_gather_single for r in requests):
            return
        del captured[group]  # issued below, not captured again
        try:
            for request in requests:
                work = distributed_c10d.all_gather_single(request.dst_tensor, request.tensor, group=group,
                                                          async_op=True)
                if async_ops:
                    manager.append(work)
                else:
                    work.wait()
        finally:
            captured[group] = []  # torch's exit finds an empty block and issues nothing


def install() -> None:
    """Give Megatron's DDP buffers the manager above (CPU mode only: the module docstring)."""
    from megatron.core.distributed import param_and_grad_buffer

    param_and_grad_buffer._coalescing_manager = coalescing_manager
