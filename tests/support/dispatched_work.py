"""What one real megatron-core local-spec layer dispatches, op by op: bytes, GEMM FLOPs and live memory.

In eager mode the GPU runs about one kernel per aten operation, so the operations a layer's forward and
backward dispatch (recorded here under a ``TorchDispatchMode``, on CPU) are its kernel list: the work the
projection must count for the local spec (``primuspipe.projection.compute``, ``activations``). Live bytes follow
storages: a storage's Python object lives as long as the storage, so a weak reference to it says when the caching
allocator would get the block back (as ``torch.distributed._tools.mem_tracker`` does); views allocate nothing.

``split=True`` runs the backward as primuspipe's Megatron backend runs a split-backward ``B`` node (inside
:meth:`~primuspipe.backends.megatron.wgrad_store.WeightGradStore.collecting`, the linear layers' weight GEMMs
deferred) and then its ``W`` (:meth:`~primuspipe.backends.megatron.wgrad_store.WeightGradStore.flush`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from projection_megatron import fake_parallel_state
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
NO_DATA = {"_unsafe_view", "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "detach",
           "lift_fresh"}
"""Operations that move no data (``_unsafe_view`` reshapes a 3-D ``matmul``'s output) or only allocate."""
WRITE_ONLY = {"new_zeros", "zeros_like", "zero_", "fill_", "new_full"}
"""Operations that write their output without reading their tensor argument (taken for its shape)."""
OVERWRITES = {"copy_"}
"""In-place operations that overwrite their first argument without reading it."""


@dataclass(frozen=True)
class Op:
    name: str
    phase: str
    """``forward``, ``backward`` (a split one's ``B``) or ``weight`` (its ``W``)."""
    moved: int
    """Bytes of the tensor inputs (an expanded view at the memory it spans) and outputs."""
    flops: float
    """``2 M N K`` of a GEMM (batched: times the batch); 0 otherwise."""


@dataclass
class LayerRecord:
    ops: list[Op] = field(default_factory=list)
    saved_bytes: int = 0
    """Bytes the forward created that are alive when it returns (what autograd keeps, the output, buffers)."""
    peak_bytes: int = 0
    """Peak of live bytes the forward and backward created."""
    backward_peak_bytes: int = 0
    """Peak of live bytes while the backward (a split one's ``B``) ran."""
    kept_for_w_bytes: int = 0
    """Live bytes when the backward returned, before any ``W`` ran."""

    def moved(self, phase: str) -> int:
        """Bytes the element-wise (non-GEMM) operations of ``phase`` read and write."""
        return sum(o.moved for o in self.ops if o.phase == phase and o.name not in GEMMS)

    def flops(self, phase: str) -> float:
        return sum(o.flops for o in self.ops if o.phase == phase)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _read(t: torch.Tensor) -> int:
    """Bytes of memory an input spans: an expanded (stride 0) dimension is read once, not once per copy."""
    size = t.element_size()
    for n, stride in zip(t.shape, t.stride()):
        size *= n if stride else 1
    return size


def _gemm_flops(name: str, args: tuple) -> float:
    a, b = args[-2], args[-1]  # addmm / baddbmm take the added input first
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class _Recorder(TorchDispatchMode):
    def __init__(self, record: LayerRecord) -> None:
        super().__init__()
        self.record, self.phase, self.live = record, "forward", 0
        self.seen: set[int] = set()
        self.refs: list[weakref.ref] = []

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self.seen or size == 0:
            return
        self.seen.add(key)
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
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name not in NO_DATA:
            inputs = [] if name in WRITE_ONLY else tree_leaves((args[1:] if name in OVERWRITES else args, kwargs))
            moved = sum(_read(t) for t in inputs if isinstance(t, torch.Tensor)) + sum(_bytes(t) for t in outputs)
            self.record.ops.append(Op(name, self.phase, moved, _gemm_flops(name, args) if name in GEMMS else 0.0))
        if not name.endswith("_"):  # an in-place operation allocates nothing
            for t in outputs:
                self._track(t)
        return out


def _drop_gradients(module: torch.nn.Module) -> None:
    """As megatron-core's DDP does with each parameter's gradient (its hook adds it into the main-gradient buffer,
    allocated before the step, and drops it): the gradient is gone once accumulated."""
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def _record(run_forward, module: torch.nn.Module, split: bool, drop_gradients: bool) -> LayerRecord:
    """Forward (``run_forward()`` returns what backward starts from and its gradient) and backward (split: ``B``,
    then ``W`` as phase ``weight``), recorded; ``drop_gradients``: :func:`_drop_gradients`."""
    from primuspipe.backends.megatron.wgrad_store import WeightGradStore

    if drop_gradients:
        _drop_gradients(module)
    record = LayerRecord()
    recorder = _Recorder(record)
    store = WeightGradStore([module])
    with recorder:
        out, grad = run_forward()
    record.saved_bytes = recorder.live
    with recorder:
        recorder.phase = "backward"
        with store.collecting(0, 0) if split else contextlib.nullcontext():
            out.backward(grad)
        record.kept_for_w_bytes = recorder.live
        recorder.phase = "weight"
        if split:
            store.flush(0, 0)
    return record


def record_model(model, training, split: bool = False, drop_gradients: bool = False) -> LayerRecord:
    """One microbatch through the whole model (``GPTModel`` of the TE-free spec: embedding, every layer, final
    norm, output layer, the vocab-parallel cross entropy), forward and backward (``split``: B then W), on CPU."""
    from primuspipe.projection.benchmark.megatron_model import DTYPES, build_gpt_chunk, causal_mask, transformer_config

    with fake_parallel_state(training):
        config = transformer_config(model, training)
        gpt = build_gpt_chunk(model, training, config, vp_stage=None, pre_process=True, post_process=True)
        gpt = gpt.to(DTYPES[training.precision])
        b, s = training.micro_batch_size, model.seq_length
        tokens = torch.randint(model.padded_vocab(1), (b, s), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = causal_mask(s)

        def forward():
            loss = gpt(tokens, positions, mask, labels=tokens).float().sum()
            return loss, torch.ones_like(loss)

        return _record(forward, gpt, split, drop_gradients)


def record_layer(model, training, kind: str = "dense", split: bool = False, drop_gradients: bool = False
                 ) -> LayerRecord:
    """Forward and backward of one layer of ``kind`` from megatron-core's local spec, for the specs (the
    training's precision and kernels; the projection's own Megatron config builder), on CPU, with the explicit
    causal mask ``GPTModel`` is given (under sequence parallelism this rank's share of the tokens); ``split``: its
    backward as a ``B`` then a ``W``."""
    from primuspipe.projection.benchmark.megatron_model import DTYPES, build_layer, causal_mask, transformer_config

    with fake_parallel_state(training):
        config = transformer_config(model, training, sequence_parallel=training.sequence_parallel)
        layer = build_layer(model, training, kind, config)
        generator = torch.Generator().manual_seed(0)
        dtype, tokens = DTYPES[training.precision], model.seq_length // training.cp
        shape = (tokens // (training.tp if training.sequence_parallel else 1), training.micro_batch_size,
                 model.hidden_size)
        x = torch.randn(shape, generator=generator).to(dtype).requires_grad_()
        grad = torch.randn(shape, generator=generator).to(dtype)
        mask = causal_mask(tokens)
        return _record(lambda: (layer(x, attention_mask=mask)[0], grad), layer, split, drop_gradients)


def cuda_softmax_product(model, training) -> tuple[int, int]:
    """What a CPU record of the local attention lacks: PyTorch's GPU softmax backward makes ``grad * output``
    before its kernel (``softmax_backward_cuda_out``, ``SoftMax.cu``), a score-sized temporary the CPU kernel does
    without, which the projection (pricing a GPU) counts. Elements of the score matrix, and the bytes of one score
    in the softmax gradient's dtype."""
    scores = training.micro_batch_size * model.num_attention_heads * model.seq_length ** 2
    return scores, 4 if training.attention_softmax_in_fp32 else 2
