"""What crosses between stages: each stage's input and output tensors, inferred once from a microbatch.

A stage is called as ``module(*inputs)`` and returns a tensor or a tuple of tensors (as in
torch.distributed.pipelining); a tuple output is the next stage's positional inputs. Receive buffers
need those shapes and dtypes before any data arrives, so before the first step every rank runs each of
its stages once on a stand-in microbatch, in stage order: the first stage on the step's microbatch 0,
every other stage on zeros shaped like what the previous stage sent. The result goes to the next
stage's rank once (``send_object_list``), never with the messages of a step. That forward runs under
``torch.no_grad`` on the unwrapped module, with buffers (e.g. BatchNorm statistics) and the RNG state
restored afterwards, so it changes nothing the step computes.

A tensor carries a gradient back when its dtype is floating point or complex; both sides of a transfer
decide that from the same metadata, so a gradient message always has one tensor per such activation
(an integer mask passed along gets none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from primuspipe.errors import ConfigError
from primuspipe.ir.placement import Placement


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def carries_grad(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype)

    def empty(self, device: torch.device, requires_grad: bool = False) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device, requires_grad=requires_grad)


@dataclass(frozen=True)
class StageMeta:
    """A stage's positional inputs and its outputs, as the neighbouring stages exchange them."""

    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]

    @property
    def grad_outputs(self) -> tuple[TensorMeta, ...]:
        """The gradients this stage receives back: one per output that carries one."""
        return tuple(m for m in self.outputs if m.carries_grad)


def as_tensors(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """A stage's inputs or outputs as a tuple of tensors; anything else is refused."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        kinds = ", ".join(type(v).__name__ for v in values) or "nothing"
        raise ConfigError(f"{what} must be a tensor or a tuple of tensors, got {kinds}; a pipeline stage passes "
                          "tensors to the next stage (fold other values into the modules)")
    return values


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """One transfer's payload: the tensor itself when there is one, else the tuple."""
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def unpack(payload: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors of one transfer's payload (:func:`pack`'s inverse)."""
    return payload if isinstance(payload, tuple) else (payload,)


def infer_stage_meta(modules: Sequence[torch.nn.Module], placement: Placement, rank: int,
                     first_inputs: Sequence[torch.Tensor] | None, group: Any, device: torch.device) -> list[StageMeta]:
    """Each local chunk's :class:`StageMeta`, exchanged with the neighbouring ranks (module docstring).

    Every rank of ``group`` must call this together; ``first_inputs`` is microbatch 0's inputs on the
    rank holding stage 0."""
    stages = sorted((placement.stage(rank, c), c) for c in range(placement.vpp))
    found: dict[int, StageMeta] = {}
    for stage, chunk in stages:
        if stage == 0:
            if first_inputs is None:
                raise ConfigError(f"rank {rank} holds the first stage but step() got no inputs")
            inputs = tuple(TensorMeta.of(t) for t in first_inputs)
            sample = tuple(first_inputs)
        else:
            prev = stage - 1
            inputs = found[prev].outputs if prev in found else _exchange(None, placement.rank_of(prev), group, device)
            sample = tuple(torch.zeros(m.shape, dtype=m.dtype, device=device) for m in inputs)
        outputs = _outputs(modules[chunk], sample, stage)
        found[stage] = StageMeta(inputs, outputs)
        nxt = stage + 1
        if nxt < placement.num_stages and placement.rank_of(nxt) != rank:
            _exchange(outputs, placement.rank_of(nxt), group, device)
    return [found[placement.stage(rank, c)] for c in range(placement.vpp)]


def _outputs(module: torch.nn.Module, sample: tuple[torch.Tensor, ...], stage: int) -> tuple[TensorMeta, ...]:
    plain = getattr(module, "module", module) if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    with torch.no_grad(), _restored(plain, sample[0].device if sample else None):
        try:
            out = plain(*sample)
        except (RuntimeError, TypeError, ValueError) as exc:  # the stages do not chain: one line, before any step
            got = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in sample]
            source = "the step" if stage == 0 else "the previous stage"
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"stage {stage}'s module cannot take what {source} gives it {got}: {why}; the stages "
                              "must chain (each takes what the one before returns)") from None
    return tuple(TensorMeta.of(t) for t in as_tensors(out, f"stage {stage}'s output"))


@contextlib.contextmanager
def _restored(module: torch.nn.Module, device: torch.device | None) -> Iterator[None]:
    buffers = [(b, b.clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    try:
        yield
    finally:
        for buffer, saved in buffers:
            buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def _exchange(meta: tuple[TensorMeta, ...] | None, peer: int, group: Any, device: torch.device):
    """Send ``meta`` to ``peer`` (a rank in ``group``), or receive it from there when ``meta`` is None."""
    box = [meta]
    peer_global = dist.get_global_rank(group, peer)
    on = None if device.type == "cpu" else device
    if meta is None:
        dist.recv_object_list(box, src=peer_global, group=group, device=on)
    else:
        dist.send_object_list(box, dst=peer_global, group=group, device=on)
    return box[0]
