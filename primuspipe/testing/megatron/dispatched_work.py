"""What one megatron-core local-spec transformer layer dispatches, op by op: bytes, FLOPs and live memory.

Public API
----------
``LayerShape``                         the layer and microbatch shape (frozen dataclass).
``record_local_layer(shape) -> LayerRecord``
    Builds one layer from megatron-core's ``get_gpt_layer_local_spec()`` in bf16 on CPU (single process, gloo
    world of one), runs its forward and backward under a ``TorchDispatchMode`` and returns every aten
    operation it dispatched (name, pass, bytes read and written, GEMM FLOPs) and the live bytes of the tensors
    the two passes create: what is still alive after the forward (saved for backward) and the peak.

Why
---
In eager mode the GPU runs roughly one kernel per aten operation, so this list is the layer's kernel list:
the exact work the projection (``primuspipe.projection.compute``, ``activations``) must count for the local
spec (unfused softmax in fp32, separate bias adds, ``torch.nn.LayerNorm``, GELU), instead of a guess.
Live bytes follow storages: a storage's Python object lives as long as the storage does, so a weak
reference to it says when the caching allocator would get the block back (as
``torch.distributed._tools.mem_tracker`` does). Views allocate nothing; a tensor is counted once per storage.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GEMMS = {"mm", "addmm", "bmm", "baddbmm"}


@dataclass(frozen=True)
class LayerShape:
    hidden_size: int = 256
    num_attention_heads: int = 2
    ffn_hidden_size: int = 1024
    seq_length: int = 256
    micro_batch_size: int = 2


@dataclass(frozen=True)
class Op:
    name: str
    phase: str
    """``forward`` or ``backward``."""
    read: int
    """Bytes of the tensor inputs (a broadcast input counted at its own size)."""
    written: int
    flops: float
    """2 * M * N * K of a GEMM (batched: times the batch); 0 otherwise."""


@dataclass
class LayerRecord:
    ops: list[Op] = field(default_factory=list)
    saved_bytes: int = 0
    """Bytes created by the forward still alive when it returns (what autograd keeps, plus the output)."""
    peak_bytes: int = 0
    """Peak of live bytes created during forward and backward (parameters and their gradients' buffers aside)."""
    backward_peak_bytes: int = 0
    """Of ``peak_bytes``, the peak reached during backward."""

    def moved(self, phase: str, names: set[str] | None = None) -> int:
        return sum(o.read + o.written for o in self.ops if o.phase == phase and (names is None or o.name in names))

    def flops(self, phase: str) -> float:
        return sum(o.flops for o in self.ops if o.phase == phase)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gemm_flops(name: str, args: tuple) -> float:
    if name in ("mm", "addmm"):
        a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    a, b = (args[1], args[2]) if name == "baddbmm" else (args[0], args[1])
    return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


class _Recorder(TorchDispatchMode):
    def __init__(self, record: LayerRecord) -> None:
        super().__init__()
        self.record, self.phase = record, "forward"
        self.live = 0
        self.seen: dict[int, tuple[str, int]] = {}
        self.op = ""

        self.refs: list[weakref.ref] = []

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.pop(key, None)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen[key] = (self.op, storage.nbytes())
        size = storage.nbytes()
        self.live += size
        self.refs.append(weakref.ref(storage, lambda _, k=key, s=size: self._free(k, s)))
        self.record.peak_bytes = max(self.record.peak_bytes, self.live)
        if self.phase == "backward":
            self.record.backward_peak_bytes = max(self.record.backward_peak_bytes, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        name = func.__name__.split(".")[0]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.op = f"{self.phase[0]}:{name}:{[tuple(t.shape) for t in outputs]}"
        inplace = name.endswith("_") or "out" in kwargs
        written = sum(_bytes(t) for t in outputs)
        flops = _gemm_flops(name, args) if name in GEMMS else 0.0
        if name not in ("detach", "empty", "empty_like", "zeros", "ones", "new_empty", "lift_fresh", "_to_copy") \
                or name == "_to_copy":
            self.record.ops.append(Op(name, self.phase, sum(_bytes(t) for t in inputs), written, flops))
        if not inplace:
            for t in outputs:
                self._track(t)
        return out


def record_local_layer(shape: LayerShape) -> LayerRecord:
    """Forward and backward of one local-spec layer (LayerNorm, biased linears, GELU, megatron-core's
    ``DotProductAttention`` with ``masked_softmax_fusion`` off and the softmax in fp32, no dropout) in bf16."""
    from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed, enable_cpu_mode

    enable_cpu_mode()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        cpu_rng_seed(0)
        config = TransformerConfig(
            num_layers=1, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
            ffn_hidden_size=shape.ffn_hidden_size, params_dtype=torch.bfloat16, bf16=True,
            pipeline_dtype=torch.bfloat16, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False, attention_softmax_in_fp32=True)
        layer = build_module(get_gpt_layer_local_spec(),
                             config=config, layer_number=1)
        gen = torch.Generator().manual_seed(0)
        s, b, h = shape.seq_length, shape.micro_batch_size, shape.hidden_size
        x = torch.randn(s, b, h, generator=gen).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(s, b, h, generator=gen).to(torch.bfloat16)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)  # as the example's
        record = LayerRecord()
        recorder = _Recorder(record)
        with recorder:
            out, _ = layer(x, attention_mask=mask)
        record.saved_bytes = recorder.live
        del _
        with recorder:
            recorder.phase = "backward"
            out.backward(grad)
        return record
    finally:
        parallel_state.destroy_model_parallel()


def scores(shape: LayerShape) -> int:
    """Elements of one layer's attention score matrix."""
    return shape.micro_batch_size * shape.num_attention_heads * shape.seq_length ** 2


__all__ = ["LayerShape", "LayerRecord", "Op", "record_local_layer", "scores", "math"]
