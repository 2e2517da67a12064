"""The plain-torch binder: one step of this rank's stage modules under any table.

``F`` runs the chunk's module on the microbatch (the first stage) or on what it received, and the
loss on the last stage; ``BW`` is one ``torch.autograd.backward`` (as torch.distributed.pipelining's
full backward); ``B`` computes the input gradients only and leaves the weight-gradient work of its
microbatch to ``W`` (:mod:`primuspipe.backends.torch.split_backward`). Paired nodes (``FB``,
``FBW``) have no handler of their own: the runner runs their parts in turn, F then B (not concurrently). ``OFFLOAD`` and ``RELOAD``
move a forward's saved activations to host memory and back (:mod:`primuspipe.runtime.activation_offload`).

Around the compute parts the binder does the resource plan of :mod:`primuspipe.ir.resources`: FSDP
unshards and reshards, and after the part that completes a stage's last weight gradient, the
gradient reduction across replicas and the division by the microbatch count
(:mod:`primuspipe.backends.torch.data_parallel`). One binder serves one step; its state is keyed by
``(chunk, microbatch)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from primuspipe.backends.torch import data_parallel
from primuspipe.backends.torch.meta import StageMeta, as_tensors, pack, unpack
from primuspipe.runtime.activation_offload import ActivationOffload
from primuspipe.backends.torch.split_backward import DeferredWeightGrad, backward_input
from primuspipe.errors import ConfigError, WeightGradError
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.resources import Resource, ResourceAction, resource_plan
from primuspipe.ir.table import ScheduleTable
from primuspipe.runtime.driver import last_backwards
from primuspipe.runtime.protocols import ComputeCall, named_handlers

Key = tuple[int, int]
"""``(chunk, microbatch)``."""


@dataclass(frozen=True)
class StepData:
    """What one step feeds the stages."""

    inputs: Sequence[tuple[torch.Tensor, ...]] | None
    """Per microbatch, the first stage's positional inputs (None on ranks without the first stage)."""
    targets: Sequence[Any] | None
    """Per microbatch, the loss function's target (None: ``loss_fn(output)``)."""
    loss_fn: Callable[..., torch.Tensor] | None
    """The last stage's loss; None runs the forward only and keeps the outputs."""
    training: bool
    scale: int
    """What the gradients are divided by at the end of the step (1: no scaling)."""


class TorchBinder:
    """Handlers ``F``, ``B``, ``W``, ``BW`` (and, given an :class:`ActivationOffload`, ``OFFLOAD`` and
    ``RELOAD``) over this rank's chunk modules, for one step of ``table``."""

    def __init__(self, table: ScheduleTable, rank: int, modules: Sequence[torch.nn.Module], meta: Sequence[StageMeta],
                 data: StepData, device: torch.device, offload: ActivationOffload | None = None):
        self.modules, self.meta, self.data, self.device = list(modules), list(meta), data, device
        self.offload = offload
        self.last_stage = table.num_stages - 1
        self.losses: dict[int, torch.Tensor] = {}
        """microbatch -> its loss (detached), on the rank with the last stage."""
        self.outputs: dict[int, Any] = {}
        """microbatch -> the last stage's output, kept when evaluating."""
        self._chunk_of = {table.placement.stage(rank, c): c for c in range(table.vpp)}
        self._saved: dict[Key, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self._deferred: dict[Key, DeferredWeightGrad] = {}
        last = last_backwards(table, rank)
        self._last_backward = set(last.items())
        plan = resource_plan(table, rank)
        row = table.ranks[rank]
        # keyed by a node's first part (before) or last part (after): an overlapped node's parts run in turn
        self._before = {row[i].parts()[0]: actions for i, actions in plan.before.items()}
        self._after = {row[i].parts()[-1]: actions for i, actions in plan.after.items()}
        self._at_end = plan.at_end
        self.handlers = MappingProxyType(named_handlers(self) | (offload.handlers() if offload is not None else {}))

    # -- compute ------------------------------------------------------------------------------------
    def forward(self, call: ComputeCall) -> Any:
        self._resources(self._before, call)
        module = self.modules[call.chunk]
        if call.stage == 0:
            inputs = self.data.inputs[call.microbatch]
        else:
            inputs = unpack(call.received)
        saving = self.offload.forward(call.chunk, call.microbatch) if self.offload and self.data.training else nullcontext()
        with saving:
            with data_parallel.forward_context(module):
                output = module(*inputs)
            if call.stage == self.last_stage and self.data.loss_fn is not None:
                target = () if self.data.targets is None else (self.data.targets[call.microbatch],)
                loss = _checked_loss(self.data.loss_fn(output, *target), call.microbatch, self.data.training)
        if call.stage == self.last_stage:
            if self.data.loss_fn is None:
                self.outputs[call.microbatch] = output
                return None
            self.losses[call.microbatch] = loss.detach()
            if not self.data.training:
                self.outputs[call.microbatch] = output
            outputs: tuple[torch.Tensor, ...] = (loss,)
        else:
            outputs = as_tensors(output, f"stage {call.stage}'s output")
        if self.data.training:
            # the first stage's inputs are the caller's data: no gradient is handed back for them
            self._saved[(call.chunk, call.microbatch)] = (inputs if call.stage else (), outputs)
        return None if call.stage == self.last_stage else pack([t.contiguous() for t in outputs])

    def backward(self, call: ComputeCall) -> Any:
        """``BW``: input and weight gradients in one autograd pass."""
        self._resources(self._before, call)
        inputs, roots, grads = self._backward_args(call)
        with data_parallel.backward_context(self.modules[call.chunk], self._is_last(call)):
            if roots:
                torch.autograd.backward(roots, grads)
        input_grads = [x.grad for x in inputs]
        for x in inputs:
            x.grad = None
        return self._finish_backward(call, input_grads)

    def backward_input(self, call: ComputeCall) -> Any:
        """``B``: the input gradients now; the weight-gradient work waits for this microbatch's ``W``."""
        key = (call.chunk, call.microbatch)
        if key in self._deferred:
            raise WeightGradError(f"B{call.microbatch}.{call.chunk} ran twice in one step; the table must have one B "
                                  "per (chunk, microbatch)")
        self._resources(self._before, call)
        inputs, roots, grads = self._backward_args(call)
        with data_parallel.backward_context(self.modules[call.chunk], False):
            input_grads, self._deferred[key] = backward_input(roots, grads, inputs)
        return self._finish_backward(call, input_grads)

    def backward_weight(self, call: ComputeCall) -> None:
        """``W``: the weight gradients its ``B`` deferred."""
        self._resources(self._before, call)
        try:
            deferred = self._deferred.pop((call.chunk, call.microbatch))
        except KeyError:
            raise WeightGradError(f"W{call.microbatch}.{call.chunk} has no deferred weight gradients: its B did not "
                                  "run before it on this rank in this step, or its W already ran") from None
        with data_parallel.backward_context(self.modules[call.chunk], self._is_last(call)):
            deferred.run()
        self._resources(self._after, call)

    def _backward_args(self, call: ComputeCall):
        """The stage inputs that get a gradient, and the roots and gradients autograd starts from."""
        inputs, outputs = self._saved.pop((call.chunk, call.microbatch))
        if call.stage == self.last_stage:
            return [x for x in inputs if x.requires_grad], list(outputs), [None]
        received = unpack(call.received)
        carrying = [t for t, m in zip(outputs, self.meta[call.chunk].outputs) if m.carries_grad]
        pairs = [(t, g) for t, g in zip(carrying, received) if t.requires_grad]
        return [x for x in inputs if x.requires_grad], [t for t, _ in pairs], [g for _, g in pairs]

    def _finish_backward(self, call: ComputeCall, input_grads: Sequence[torch.Tensor | None]) -> Any:
        self._resources(self._after, call)
        if call.stage == 0:
            return None
        wanted = [m for m in self.meta[call.chunk].inputs if m.carries_grad]
        assert len(wanted) == len(input_grads), "received inputs require grad exactly when they carry one"
        return pack([torch.zeros(m.shape, dtype=m.dtype, device=self.device) if g is None else g
                     for g, m in zip(input_grads, wanted)])

    def _is_last(self, call: ComputeCall) -> bool:
        return (call.chunk, call.microbatch) in self._last_backward

    # -- resources ----------------------------------------------------------------------------------
    def _resources(self, where: dict, call: ComputeCall) -> None:
        for action in where.get((call.kind, call.microbatch, call.chunk), ()):
            self._do(action)

    def _do(self, action: ResourceAction) -> None:
        module = self.modules[self._chunk_of[action.stage]]
        if action.resource is Resource.UNSHARD:
            data_parallel.unshard(module)
        elif action.resource is Resource.RESHARD:
            data_parallel.reshard(module)
        elif self.data.training:
            data_parallel.reduce_gradients(module)
            data_parallel.scale_gradients(module, self.data.scale)

    def finish(self) -> None:
        """After the row: the last reshards, and a check that every ``B`` met its ``W``."""
        for action in self._at_end:
            self._do(action)
        if self._deferred:
            missing = ", ".join(f"W{mb}.{c}" for c, mb in sorted(self._deferred))
            raise WeightGradError(f"the step ended with weight gradients never applied: {missing} did not run")

    # -- tensors the runner moves -------------------------------------------------------------------
    def recv_buffer(self, node: ScheduleNode) -> Any:
        meta = self.meta[node.chunk]
        if node.kind.carries is NodeKind.F:
            return pack([m.empty(self.device, requires_grad=m.carries_grad) for m in meta.inputs])
        return pack([m.empty(self.device) for m in meta.grad_outputs])

    def local_handoff(self, tensor: Any, carries: NodeKind) -> Any:
        forward = carries is NodeKind.F
        return pack([t.detach().requires_grad_(forward and (t.is_floating_point() or t.is_complex()))
                     for t in unpack(tensor)])

    def sent(self, node: ScheduleNode, tensor: Any) -> None:
        pass


def _checked_loss(loss: Any, microbatch: int, training: bool) -> torch.Tensor:
    """``loss_fn``'s result, refused in one line unless it is a tensor -- and, in a training step, one value
    with a gradient to run the backward from (else an AttributeError in this binder, or torch's "grad can be
    implicitly created only for scalar outputs" / "does not require grad" from inside the backward)."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"loss_fn returned {type(loss).__name__} for microbatch {microbatch}; it must return the "
                          "loss as a tensor (a scalar, e.g. torch.nn.functional.mse_loss(output, target))")
    if training and (loss.numel() != 1 or not loss.requires_grad):
        got = (f"shape {tuple(loss.shape)}" if loss.numel() != 1
               else "no gradient (detached, or not computed from the output)")
        raise ConfigError(f"loss_fn returned a tensor of {got} for microbatch {microbatch}; step() runs the backward "
                          "from one loss value computed from the output: reduce it (e.g. .mean()) and do not detach it")
    return loss
