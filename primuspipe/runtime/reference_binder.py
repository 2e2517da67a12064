"""The reference binder: runs a table on plain torch modules, one module per local chunk.

It is the smallest complete :class:`~primuspipe.runtime.runner.Binder` (``F`` and ``BW``, one fixed
transfer shape), used to test the runner core without Megatron and as a template for other backends.
To train a PyTorch model, use the plain-torch backend, :mod:`primuspipe.backends.torch`. Per-step state (what ``BW`` needs from
its ``F``) lives in a dict keyed by ``(chunk, microbatch)``; build a new binder per step.

The first stage's ``F`` reads ``inputs[microbatch]``; the last stage's ``F`` applies
``loss_fn(output, microbatch)`` and its ``BW`` starts from that loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType

import torch

from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.runtime.protocols import ComputeCall, named_handlers


class ModuleBinder:
    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        *,
        num_stages: int,
        inputs: Sequence[torch.Tensor],
        loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
        transfer_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
    ):
        self.chunks = list(chunks)
        self.last_stage = num_stages - 1
        self.inputs = inputs
        self.loss_fn = loss_fn
        self.transfer_shape = tuple(transfer_shape)
        self.dtype = dtype
        self.losses: dict[int, torch.Tensor] = {}
        """Loss per microbatch (last stage only)."""
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.handlers = MappingProxyType(named_handlers(self))

    def forward(self, call: ComputeCall) -> torch.Tensor:
        x = self.inputs[call.microbatch] if call.stage == 0 else call.received
        y = self.chunks[call.chunk](x)
        if call.stage == self.last_stage:
            y = self.loss_fn(y, call.microbatch)
            self.losses[call.microbatch] = y.detach()
        self._saved[(call.chunk, call.microbatch)] = (None if call.stage == 0 else x, y)
        return y

    def backward(self, call: ComputeCall) -> torch.Tensor | None:
        x, y = self._saved.pop((call.chunk, call.microbatch))
        torch.autograd.backward(y, grad_tensors=call.received)
        return None if x is None else x.grad

    def recv_buffer(self, node: ScheduleNode) -> torch.Tensor:
        return torch.empty(self.transfer_shape, dtype=self.dtype, requires_grad=node.kind is NodeKind.RECV_F)

    def local_handoff(self, tensor: torch.Tensor, carries: NodeKind) -> torch.Tensor:
        return tensor.detach().requires_grad_(carries is NodeKind.F)

    def sent(self, node: ScheduleNode, tensor: torch.Tensor) -> None:
        pass
