"""Compute time of every pass (F, B, W) of every part of the model on one rank, for one microbatch.

Work is counted per rank as in Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM"): a GEMM over ``n`` tokens with a weight of ``p`` elements costs
``2 n p`` FLOPs forward, the same again for the input gradient (B, "dgrad") and for the weight gradient
(W, "wgrad"). Attention scores and their use (``QK^T`` and ``PV``) cost ``2 * 2 b (s/CP) s a d / TP``
forward; causal masking halves that for flash attention, which skips masked tiles (the unfused kernel
computes the full square), and a sliding window keeps only the key blocks it reaches
(:attr:`WorkModel.window_share`); the model FLOPs behind MFU count what the kernels do. Their backward is in
B: twice the forward (two GEMMs per forward GEMM), more with flash attention, which recomputes
the scores (Dao 2022, "FlashAttention-2"): ``(3 d_qk + 2 d_v) / (d_qk + d_v)`` times, 2.5 where the query/key and
value widths are equal (:meth:`WorkModel._attention_core`). Element-wise kernels (norms, residual adds, rotary
embedding, the activation function, the unfused softmax, MoE permutation) are memory-bound: each
reads its inputs and writes its output once, forward; twice that backward, in B.

Times: GEMM and attention FLOPs at ``peak * achievable_fraction`` (half of it in fp32), element-wise
bytes at ``HBM bandwidth * memory_bandwidth_fraction``. Recompute re-runs forward work in B: a whole
layer's under full recompute, the recomputed modules' under selective recompute, the GEMMs and element-wise
kernels torchtitan's op policy does not save under op recompute (:meth:`WorkModel._op_recompute`).

A :class:`Calibration` scales these analytical times by measured factors, per part and pass: from
the layer benchmark (real megatron-core layers timed on the local device) or from a run's dump.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from primuspipe.projection.activations import MASK_BYTES, gemm_width, op_gemms
from primuspipe.projection.comm import gathered_weight_bytes
from primuspipe.projection.gemm import Gemm, gemm_seconds
from primuspipe.projection.hardware_spec import HardwareSpec, check_runs_on
from primuspipe.projection.host import host_priced, layer_host, moe_small_kernels, moe_stream_kernels
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.parameters import ParamCount, embedding_params, head_params, layer_params
from primuspipe.projection.training_spec import MXFP8_BLOCK, RankShape, TrainingSpec

PASSES = ("forward", "backward_input", "backward_weight")
ATTENTION_BLOCK = 128
"""Queries and keys per block of a flash attention kernel (FlashAttention-2's and cuDNN's tiles for head
dimensions up to 128): the granularity at which a sliding window's masked work is skipped."""
CUDA_SOFTMAX_BACKWARD_PRODUCT = 3
"""Score-matrix passes of the ``grad * output`` temporary PyTorch's GPU softmax backward makes before its kernel
(``softmax_backward_cuda_out`` in ``SoftMax.cu``; read the gradient and the probabilities, write the product), which
the CPU kernel does without: what an unfused softmax moves on a GPU beyond the aten operations a CPU run dispatches."""
FLOP_CONVENTIONS = ("causal", "full")
"""How model FLOPs count attention: ``causal`` the half of the score square a causal mask keeps (what the
kernels compute), ``full`` the whole square (Narayanan et al. 2021's formula, as NVIDIA's NeMo /
Megatron-Bridge and AMD's Primus report Model TFLOP/s)."""
PARTS = ("dense", "moe", "embedding", "head", "mtp")
"""The parts the model is timed in: a layer of each kind, the first stage's extra, the last's, and one
multi-token-prediction module (with ``mtp_num_layers``; on the last stage)."""
EAGER_RMSNORM_BYTES = (36, 96)
"""Bytes torchtitan's eager ``RMSNorm`` (``elementwise_kernels: torchtitan-eager``; ``torchtitan/models/norms.py`` at
9dec370: ``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * weight``) moves per element of its bf16
input, forward and backward, counted as every aten op's tensor inputs and outputs (views aside). Forward: the fp32
copy (2 + 4), ``pow`` (4 + 4), ``mean`` (4), the product with the per-row ``rsqrt`` (4 + 4), ``type_as`` (4 + 2), the
weight's product (2 + 2). Backward: the weight's product's two gradients (3 x 2 and 2 x 2, the weight's row sum 2),
``type_as``'s (2 + 4), the product's (``grad * rsqrt`` 8, ``grad * x`` 12 and its row sum 4), ``mean``'s expanded
division (8), ``pow``'s (``x.pow(1)`` 8, ``* 2`` 8, ``* grad`` 12), the two branches' sum (12) and the fp32 copy's
(4 + 2). Held against the ops the code dispatches (``tests/projection/test_time_model.py``)."""
EAGER_SWIGLU_BYTES = (10, 18)
"""Bytes torchtitan's eager ``F.silu(w1(x)) * w3(x)`` moves per element of one bf16 half, forward (``silu`` 2 + 2,
the product 3 x 2) and backward (the product's two gradients 3 x 2 each, ``silu_backward`` 3 x 2), against
megatron-core's fused kernel's 6 and 10."""
EAGER_ROPE_BYTES = (20, 20)
"""Bytes torchtitan's eager ``apply_rotary_emb`` (the complex-number form: ``view_as_complex(x.float())``, the
product with ``freqs_cis``, ``view_as_real(...).type_as(x)``) moves per bf16 query or key element, forward (the fp32
copy 2 + 4, the complex product 4 + 4, ``type_as`` 4 + 2) and backward (the same three in reverse), where
megatron-core's unfused chain (:meth:`WorkModel._unfused_rope`) moves 24 and 28."""
BACKWARD_BYTES_PER_FORWARD_BYTE = {
    "norm": 1.5,  # forward reads x, writes y; backward reads x and dy, writes dx (RMSNorm/LayerNorm backward)
    "residual_add": 1.0,  # forward reads two, writes one; backward adds the two gradients where the stream splits
    "rope": 1.0,  # the fused rotary kernel's backward rotates dq/dk back: one read, one write, as forward
    "swiglu": 5 / 3,  # forward reads 2F, writes F; megatron-core's swiglu_back reads 2F and dF, writes 2F
    "gelu": 1.5,  # forward reads F, writes F; bias_gelu_back reads F and dF, writes F
    # eager squared ReLU (NeMo 2's ``torch.pow(F.relu(x), 2)``): forward relu and pow, each reads F and writes F (4F);
    # backward autograd's pow_backward, ``grad * (2 * x.pow(1))`` (pow's exponent-1 copy, the scalar product, the
    # product with the gradient: 2F + 2F + 3F) and relu's threshold_backward (reads the gradient and relu's output,
    # writes dF: 3F), 10F
    "squared_relu": 10 / 4,
    "rmsnorm_eager": EAGER_RMSNORM_BYTES[1] / EAGER_RMSNORM_BYTES[0],
    "swiglu_eager": EAGER_SWIGLU_BYTES[1] / EAGER_SWIGLU_BYTES[0],
    "permute": 1.0,  # a permutation's gradient is the inverse permutation: same reads and writes
    "router": 1.0,  # softmax / top-k backward reads the probabilities and their gradient, writes the logits'
}
"""Memory traffic of an element-wise kernel's backward per byte of its forward, by kernel: what each reads and
writes (the autograd functions of megatron-core and Transformer Engine), instead of one factor for all."""


@dataclass(frozen=True)
class Work:
    """What one pass of one part does on one rank."""

    gemms: tuple[Gemm, ...] = ()
    """The pass's GEMMs by shape (timed by :func:`~primuspipe.projection.gemm.gemm_seconds`)."""
    attention_flops: float = 0.0
    dropped_attention_flops: float = 0.0
    """Of ``attention_flops``, those of fused kernels that apply ``attention_dropout`` inside (a Philox draw per
    score), timed at the hardware's ``attention_dropout_rate`` of the plain kernels' rate."""
    memory_bytes: float = 0.0
    """Bytes moved by element-wise (memory-bound) kernels."""
    mxfp8_cast_bytes: float = 0.0
    """Bytes moved by MXFP8 quantize kernels, timed at the hardware's ``mxfp8_cast_bandwidth_fraction``."""
    fp8_transpose_bytes: float = 0.0
    """Bytes per-tensor FP8 casts move for the transposed copies Hopper's FP8 GEMMs need; hardware whose FP8
    GEMMs take any layout (``fp8_gemm_any_layout``) makes none."""
    scatter_add_elements: float = 0.0
    """Elements accumulating scatters (``scatter_add_``, ``index_add_``) add, timed at the hardware's
    ``scatter_add_elements_per_s`` where it gives it, else as the ``scatter_add_bytes`` they move."""
    scatter_add_bytes: float = 0.0
    """Bytes those scatters read and write, their cost as plain copies."""

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops for g in self.gemms)

    def __add__(self, other: Work) -> Work:
        return Work(self.gemms + other.gemms, **{name: getattr(self, name) + getattr(other, name) for name in AMOUNTS})

    def scaled(self, factor: float) -> Work:
        gemms = tuple(g.times(factor) for g in self.gemms)
        return Work(gemms, **{name: getattr(self, name) * factor for name in AMOUNTS})

    def gemm_seconds(self, hardware: HardwareSpec, precision: str) -> float:
        return sum(gemm_seconds(g, hardware, precision) for g in self.gemms)

    def attention_seconds(self, hardware: HardwareSpec, precision: str, length: float | None = None,
                          head_dim: float | None = None, backward: bool = False) -> float:
        """Seconds of the attention kernels; ``length``: the queries one kernel sees, ``head_dim``: its heads'
        query/key width (the rate depends on them where the hardware file gives ``attention_length_rates`` and
        ``attention_head_dim_rates``); ``backward``: the kernels are a backward pass's (at
        ``attention_backward_length_rates`` where the file gives them)."""
        slow = 0.5 if precision == "fp32" else 1.0
        rate = hardware.attention_rate(length, head_dim, backward)
        flops = self.attention_flops + self.dropped_attention_flops * (1 / hardware.attention_dropout_rate - 1)
        return flops / (hardware.peak_bf16_tflops * 1e12 * hardware.attention_fraction * slow * rate)

    def seconds(self, hardware: HardwareSpec, precision: str, length: float | None = None,
                head_dim: float | None = None, backward: bool = False) -> float:
        bytes_per_s = hardware.hbm_bandwidth_bytes_per_s * hardware.memory_bandwidth_fraction
        cast_per_s = hardware.hbm_bandwidth_bytes_per_s * hardware.mxfp8_cast_fraction
        moved = self.memory_bytes + (0.0 if hardware.fp8_gemm_any_layout else self.fp8_transpose_bytes)
        scatter_rate = hardware.scatter_add_elements_per_s
        scatters = (self.scatter_add_elements / scatter_rate if scatter_rate is not None
                    else self.scatter_add_bytes / bytes_per_s)
        return (self.gemm_seconds(hardware, precision)
                + self.attention_seconds(hardware, precision, length, head_dim, backward)
                + moved / bytes_per_s + self.mxfp8_cast_bytes / cast_per_s + scatters)


AMOUNTS = tuple(f.name for f in fields(Work) if f.name != "gemms")
"""The fields of :class:`Work` besides its GEMMs: quantities that add up and scale alike."""


@dataclass(frozen=True)
class PassWork:
    """Forward, input-gradient and weight-gradient work of one part; ``recompute`` is the forward work a
    selective recompute repeats in B (a full recompute repeats all of ``forward``)."""

    forward: Work
    backward_input: Work
    backward_weight: Work
    recompute: Work = Work()

    def passes(self) -> tuple[Work, Work, Work]:
        return self.forward, self.backward_input, self.backward_weight


NO_WORK = PassWork(Work(), Work(), Work())
"""A part that does nothing in any pass (a feature the run does not use)."""


@dataclass(frozen=True)
class WorkModel(RankShape):
    """Per-rank work of each part of the model for one microbatch."""

    def _linear(self, tokens: float, fan_in: float, fan_out: float, *, groups: float = 1, fp8: bool | None = None,
                norm_fed: bool = False, tensor_parallel: str = "", stretch: float = 1.0,
                split: tuple[float, ...] = ()) -> PassWork:
        """A linear layer over ``tokens``: its forward, input-gradient and weight-gradient GEMMs. Under FP8
        the input and the output gradient are quantized first (:meth:`_quantize_bytes`): ``norm_fed``, the input
        is a norm's output (a LayerNormLinear); ``tensor_parallel`` ``column`` or ``row``, the layer's TP split,
        which says (with sequence parallelism) whether its input or its output gradient is all-gathered;
        ``stretch``, the share of copies the experts hold beyond ``tokens`` (:attr:`Gemm.stretch`); ``split``, the
        output widths (summing to ``fan_out``) of the separate linears that share this input where the model's code
        does not fuse them (:meth:`_separate_linears`): a GEMM each, their input cast once."""
        fp8 = self.training.fp8 if fp8 is None else fp8
        gemms = [Gemm(tokens, width, fan_in, groups, fp8, mxfp8=fp8 and self.training.fp8_recipe == "mxfp8",
                      kernel=self.training.expert_gemm_kernel, streams=self.training.expert_gemm_streams, stretch=stretch)
                 for width in split or (fan_out,)]
        assert abs(sum(g.n for g in gemms) - fan_out) <= 1e-9 * fan_out, "split widths sum to fan_out"
        runs = [self._async_tp_split(gemm, tensor_parallel) for gemm in gemms]
        forward = Work(tuple(f for f, _ in runs))
        dgrad = Work(tuple(d for _, d in runs))
        wgrad = Work(tuple(g.wgrad() for g in gemms))
        if not fp8:
            return PassWork(forward, dgrad, wgrad)
        sp = self.training.sp
        elements = tokens * groups * stretch
        fwd = self._cast(elements * fan_in, norm_fed=norm_fed, gathered=sp and tensor_parallel == "column")
        bwd = self._cast(elements * fan_out, gathered=sp and tensor_parallel == "row")
        return PassWork(forward + fwd, dgrad + bwd, wgrad)

    def _separate_linears(self, *widths: float) -> tuple[float, ...]:
        """The output widths of linears that megatron-core fuses into one GEMM (QKV; SwiGLU's gate and up) where
        the model's code keeps them apart (``model_implementation: torchtitan``: ``wq``, ``wk``, ``wv``; ``w1``,
        ``w3``), else () -- one GEMM."""
        return widths if self.training.model_implementation == "torchtitan" else ()

    def _async_tp_split(self, gemm: Gemm, tensor_parallel: str) -> tuple[Gemm, Gemm]:
        """The forward and input-gradient GEMMs of a linear split over TP as they run: whole, except under PyTorch's
        async TP (``tp_comm_overlap_impl: torch-async-tp``), whose fused collectives run their matmul as ``TP``
        matmuls of ``m / TP`` rows one after another, one per step (``_pipelined_all_gather_and_consume`` calls
        the matmuls once per gathered shard, ``_pipelined_produce_and_all2all`` once per destination rank; torch
        ``distributed/_symmetric_memory``): a column-parallel linear's forward (fed by the gather) and a
        row-parallel linear's forward (feeding the reduce-scatter) and input gradient (fed by the gather of the
        output gradient; see :meth:`~primuspipe.projection.comm.LayerComm.exposed`)."""
        t = self.training
        if not (t.tp_comm_overlap and t.tp_comm_overlap_impl == "torch-async-tp" and t.tp > 1 and tensor_parallel):
            return gemm, gemm.dgrad()
        split = replace(gemm, m=gemm.m / t.tp, groups=gemm.groups * t.tp, kernel="sequential")
        return split, split.dgrad() if tensor_parallel == "row" else gemm.dgrad()

    def _cast(self, elements: float, *, norm_fed: bool = False, gathered: bool = False) -> Work:
        """The quantization of one GEMM operand as work: :meth:`_quantize_bytes`, MXFP8's as MXFP8 cast bytes,
        a per-tensor recipe's transposed copy (:meth:`_transpose_bytes`) apart from the rest."""
        total = self._quantize_bytes(elements, norm_fed=norm_fed, gathered=gathered)
        if self.training.fp8_recipe == "mxfp8":
            return Work(mxfp8_cast_bytes=total)
        transpose = self._transpose_bytes(elements, norm_fed=norm_fed, gathered=gathered)
        return Work(memory_bytes=total - transpose, fp8_transpose_bytes=transpose)

    def _transpose_bytes(self, elements: float, *, norm_fed: bool = False, gathered: bool = False) -> float:
        """Of :meth:`_quantize_bytes`, what a per-tensor recipe spends on the transposed copy: its write (1 byte per
        element) where the cast kernel makes it alongside the row-wise copy, a read and a write (2) where it is
        made from an FP8 copy afterwards (a delayed-scaling norm's FP8 output, a gathered operand). Hardware whose
        FP8 GEMMs take any layout skips it: Transformer Engine 2.12 quantizes without the transpose where
        ``nvte_is_non_tn_fp8_gemm_supported()`` (compute capability 10.x and 13+: Blackwell; ``csrc/quantizer.cpp``,
        ``with_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported()``)."""
        t = self.training
        if not t.per_tensor_fp8:
            return 0.0
        after = gathered or (norm_fed and t.fp8_recipe == "delayed")
        return (2 if after else 1) * elements

    def _quantize_bytes(self, elements: float, *, norm_fed: bool = False, gathered: bool = False) -> float:
        """HBM bytes Transformer Engine moves to quantize one GEMM operand of ``elements`` (its full size on the
        rank, after any gather) to FP8, row-wise and transposed (Hopper's FP8 GEMMs take both operands K-major,
        so the wgrad and dgrad GEMMs need the transposes).

        Per-tensor scaling as TE 2.x does it (``module/layernorm_linear.py``, ``distributed.py``,
        ``csrc/extensions/normalization.cpp``):

        * a plain operand: one cast-transpose kernel reads bf16 and writes both FP8 copies, 4 bytes per element;
          current scaling (``tensorwise``) first reads the operand once more for its amax: 6;
        * a norm's output (the input of QKV and of the MLP's first linear, LayerNormLinear modules) is quantized
          by the norm kernel: delayed scaling writes FP8 instead of the bf16 the norm is counted with (a byte
          less), then the transpose (read 1, write 1); current scaling has the norm kernel compute the amax and
          then casts (read 2, write 1 and 1);
        * with sequence parallelism an operand that is all-gathered over TP (the input of a column-parallel
          layer, the output gradient of a row-parallel one) is quantized row-wise on the rank's 1/TP shard and
          gathered in FP8 (TE gathers no transposes); the transpose is made from the gathered copy.

        Blockwise scaling: a cast reading 2 and writing 2 bytes per element. MXFP8 (TE 2.12,
        ``common/cast/mxfp8``, ``module/grouped_linear.py``): one kernel reads bf16 and writes the row-wise copy
        with an E8M0 scale per 32 elements along a row and the column-wise copy with one per 32 along a column
        (Blackwell's MMA takes both in place, so the column-wise copy is a second quantization, not a
        transpose), ``2 + 1 + 1 + 2/32`` bytes per element; a grouped linear quantizes every expert's slice
        so (``split_quantize``); a norm's output is not quantized by the norm kernel (``normalization.cpp`` runs
        MXFP8 norms unfused unless ``NVTE_NORM_FWD_USE_CUDNN``), so it is a plain cast too. An operand gathered
        over TP is counted as cast whole and gathered in bf16, where TE casts the 1/TP shard and gathers both
        FP8 copies with their scales (``distributed._all_gather_mxfp8``, 2 + 2/32 bytes an element against bf16's
        2): a simplification worth under 1 % of a TP layer. These bytes run at the hardware's
        ``mxfp8_cast_bandwidth_fraction`` (:class:`Work`)."""
        t = self.training
        if t.fp8_recipe == "mxfp8":
            return (4 + 2 / MXFP8_BLOCK) * elements
        if not t.per_tensor_fp8:
            return 4 * elements
        current = t.fp8_recipe == "tensorwise"
        amax = 2 if current else 0
        if not gathered:
            return elements * ((4 if current else 1) if norm_fed else 4 + amax)
        rowwise = (3 if current else -1) if norm_fed else 3 + amax  # on the shard, before the gather
        return elements * (rowwise / t.tp + 2)

    def _mlp(self, tokens: float, width: float, *, groups: float = 1, dense: bool = False, stretch: float = 1.0,
             fp8: bool | None = None) -> PassWork:
        """Up (gated with SwiGLU) and down projections of an MLP ``width`` wide on this rank; ``dense``: a dense
        layer's MLP, whose up projection takes the pre-MLP norm's output (a LayerNormLinear) and which is split
        over TP column-wise, then row-wise; ``stretch`` and ``fp8``: see :meth:`_linear`."""
        h = self.model.hidden_size
        up, down = ("column", "row") if dense else ("", "")
        gate = self._separate_linears(width, width) if dense and self.model.swiglu else ()
        return _sum(self._linear(tokens, h, width * (2 if self.model.swiglu else 1), groups=groups, norm_fed=dense,
                                 tensor_parallel=up, stretch=stretch, fp8=fp8, split=gate),
                    self._linear(tokens, width, h, groups=groups, tensor_parallel=down, stretch=stretch, fp8=fp8))

    def _attention_projections(self) -> tuple[PassWork, PassWork]:
        """(all projections of the attention block, the MLA up-projections among them)."""
        m, t, tokens, h = self.model, self.training, self.tokens, self.model.hidden_size
        heads = m.num_attention_heads / t.tp
        if not m.multi_latent_attention:
            kv = m.query_groups / t.tp * m.head_dim
            qkv = self._linear(tokens, h, heads * m.head_dim + 2 * kv, norm_fed=True, tensor_parallel="column",
                               split=self._separate_linears(heads * m.head_dim, kv, kv))
            proj = self._linear(tokens, heads * m.head_dim, h, tensor_parallel="row")
            return _sum(qkv, proj), NO_WORK
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        # The down-projections are replicated (TE's TELinear, parallel_mode "duplicated", in megatron-core 0.19's
        # MLASelfAttention) and take the layer input as it comes: the rank's 1/TP of the tokens under sequence
        # parallelism; the up-projections gather them.
        down = self.latent_tokens
        if m.q_lora_rank is None:
            query, q_up = self._linear(tokens, h, heads * qk), None
        else:
            q_up = self._linear(tokens, m.q_lora_rank, heads * qk)
            query = _sum(self._linear(down, h, m.q_lora_rank), q_up)
        kv_up = self._linear(tokens, m.kv_lora_rank, heads * (m.qk_head_dim + m.v_head_dim))
        kv = _sum(self._linear(down, h, m.kv_lora_rank + m.qk_pos_emb_head_dim), kv_up)
        ups = _sum(kv_up, *([q_up] if q_up else []))
        return _sum(query, kv, self._linear(tokens, heads * m.v_head_dim, h)), ups

    @property
    def head_dims(self) -> tuple[int, int]:
        """(query/key, value) width of one attention head."""
        m = self.model
        return ((m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim) if m.multi_latent_attention
                else (m.head_dim, m.head_dim))

    def _attention_square(self) -> float:
        """FLOPs of ``QK^T`` and ``PV`` over the whole score square of one layer and microbatch on this rank."""
        m, t = self.model, self.training
        qk, v = self.head_dims
        return 2 * t.micro_batch_size * (m.seq_length / t.cp) * m.seq_length * m.num_attention_heads / t.tp * (qk + v)

    @property
    def window_share(self) -> float:
        """Work of the model's attention kernels over causal attention's, averaged over its layers (1 without
        ``window_size``). Flash kernels walk, for each block of queries, the key blocks from the first one its
        window reaches to the diagonal, as they stop at the diagonal for causal attention (cudnn-frontend's open
        SM100 attention kernels bound the key loop by the window's left block, ``compute_kv_loop_bounds``, its pull
        request 584; FlashAttention's local attention skips the blocks outside the window likewise): with
        ``ATTENTION_BLOCK``-token blocks a windowed layer visits ``min(i + 1, ceil(left / block) + 1)`` key blocks
        for query block ``i`` where causal attention visits ``i + 1``."""
        m = self.model
        if not m.windowed_layers:
            return 1.0
        blocks = math.ceil(m.seq_length / ATTENTION_BLOCK)
        reach = math.ceil(m.window_size[0] / ATTENTION_BLOCK) + 1
        windowed = sum(min(i + 1, reach) for i in range(blocks)) / (blocks * (blocks + 1) / 2)
        return (m.windowed_layers * windowed + m.num_layers - m.windowed_layers) / m.num_layers

    def _attention_core(self) -> PassWork:
        m, t = self.model, self.training
        qk, v = self.head_dims
        square = self._attention_square()
        causal = 0.5 * square * self.window_share
        forward = causal if t.flash_attention else square  # the unfused kernel computes the square, then masks
        # a fused backward recomputes S = Q K^T (d_qk) and runs dP = dO V^T and dV = P^T dO (d_v), dQ = dS K and
        # dK = dS^T Q (d_qk): 3 d_qk + 2 d_v against the forward's d_qk + d_v, 2.6 times at MLA's 192 / 128 (as
        # NVIDIA/cudnn-frontend's SDPA training benchmark counts its backward, "5 BMMs => (3 x head_dim_qk) +
        # (2 x head_dim_vo)", benchmark/sdpa_benchmark_training/benchmark_single_sdpa.py at fb682ce); unfused: 2
        backward = (3 * qk + 2 * v) / (qk + v) * causal if t.flash_attention else 2 * square
        e = self.e
        scores = square / (qk + v) / 2  # elements of the score matrix
        if t.attention_backend == "local":
            return self._local_attention_core(scores)
        softmax = 0.0 if t.flash_attention else scores * (2 * e + (8 if t.attention_softmax_in_fp32 else 2 * e))
        dropout = 0.0 if t.flash_attention else self._score_dropout_bytes(scores)
        softmax_fwd, softmax_bwd = softmax + dropout, 2 * softmax + dropout
        ring_fwd, ring_bwd = self._ring_corrections(v)
        dropped = 1.0 if t.flash_attention and self.model.attention_dropout > 0 else 0.0
        fwd = Work(attention_flops=forward, dropped_attention_flops=dropped * forward,
                   memory_bytes=softmax_fwd + ring_fwd)
        bwd = Work(attention_flops=backward, dropped_attention_flops=dropped * backward,
                   memory_bytes=softmax_bwd + ring_bwd)
        return PassWork(fwd, bwd, Work(), recompute=fwd)

    def _local_attention_core(self, scores: float) -> PassWork:
        """megatron-core's local ``DotProductAttention`` (``transformer/dot_product_attention.py``): cuBLAS batched
        GEMMs, one per ``b a/TP`` head, timed as GEMMs by shape (:func:`~primuspipe.projection.gemm.gemm_seconds`),
        not at a fused attention kernel's rate: forward ``baddbmm`` (``Q K^T``: ``s/CP x s``, reduced over the
        query/key width) and ``bmm`` (``P V``: ``s/CP x d_v``, reduced over ``s``); backward autograd's two GEMMs
        for each (``dP = dO V^T``, ``dV = P^T dO``, ``dQ = dS K``, ``dK = dS^T Q``), all in B. The unfused softmax
        around them is :meth:`_local_softmax_bytes`. The full square is computed, then masked."""
        m, t = self.model, self.training
        qk, v = self.head_dims
        heads = t.micro_batch_size * m.num_attention_heads / t.tp
        queries, keys = m.seq_length / t.cp, m.seq_length
        scores_gemm = Gemm(queries, keys, qk, heads, kernel="fused")  # one strided-batched launch
        context_gemm = Gemm(queries, v, keys, heads, kernel="fused")
        backward = (replace(scores_gemm, k=v), replace(context_gemm, m=keys, n=v, k=queries),
                    replace(context_gemm, n=qk), replace(context_gemm, m=keys, n=qk, k=queries))
        softmax_fwd, softmax_bwd = self._local_softmax_bytes(scores)
        dropout = self._score_dropout_bytes(scores)
        fwd = Work((scores_gemm, context_gemm), memory_bytes=softmax_fwd + dropout)
        return PassWork(fwd, Work(backward, memory_bytes=softmax_bwd + dropout), Work(), recompute=fwd)

    def _score_dropout_bytes(self, scores: float) -> float:
        """Bytes ``attention_dropout`` moves over the probabilities of an attention that is not fused (megatron-core's
        ``DotProductAttention``, Transformer Engine's ``UnfusedDotProductAttention``: ``self.attention_dropout`` on
        the ``scores`` probabilities in the activations' dtype), each way: ``native_dropout`` reads them and
        writes them and the one-byte mask; its backward reads the gradient and the mask and writes the gradient.
        Fused (flash) kernels drop inside the kernel (``HardwareSpec.attention_dropout_rate``)."""
        if self.model.attention_dropout == 0:
            return 0.0
        return scores * self._native_dropout_bytes

    @property
    def _native_dropout_bytes(self) -> float:
        """Bytes ``native_dropout`` moves per element, forward (read ``e``, write ``e`` and the one-byte keep mask)
        and likewise backward (read the gradient and the mask, write the gradient)."""
        return 2 * self.e + MASK_BYTES

    def _local_softmax_bytes(self, scores: float) -> tuple[float, float]:
        """Bytes megatron-core's local ``DotProductAttention`` moves around its two batched GEMMs, forward and
        backward, for ``scores`` elements of the score matrix (``b a/TP (s/CP) s``), with ``masked_softmax_fusion``
        off: ``FusedScaleMaskSoftmax.forward_torch_softmax`` (``fusions/fused_softmax.py``) casts the low-precision
        scores ``baddbmm`` wrote to fp32 (read ``e``, write 4), masks them in place (``attention_mask_func``'s
        ``masked_fill_``: read 4 and the one-byte mask, write 4), takes the softmax (read 4, write 4) and casts the
        probabilities back (read 4, write ``e``): ``2e + 24`` an element, and the mask. Autograd's backward runs the
        same chain the other way: the gradient cast to fp32 (``e + 4``), ``_softmax_backward_data`` (reads the
        probabilities and the gradient, writes one: 12), ``masked_fill`` of the gradient (8 and the mask), the cast
        back (``4 + e``): ``2e + 28``; on a GPU PyTorch's softmax backward (``softmax_backward_cuda_out``,
        ``SoftMax.cu``) first multiplies the gradient by the probabilities into a temporary (reads two, writes
        one: 12 more, :data:`CUDA_SOFTMAX_BACKWARD_PRODUCT` passes of the score matrix; ``3e`` without the fp32
        softmax), which the CPU kernel does not. With the softmax in the activations' dtype there are no casts and
        the mask goes in place onto a view of ``baddbmm``'s output, so autograd's ``CopySlices`` rebuilds that output's
        gradient around the mask's (``new_zeros``, three ``copy_``, a ``clone``): ``4e`` forward, ``3e`` (softmax)
        ``+ e + 3 * 2e + 2e`` (the rebuild) ``+ 2e`` (the mask) ``= 14e`` backward. The mask (``[1, 1, s, s]``
        booleans, what ``GPTModel`` is given) is read whole per masking pass.
        Held against the aten operations a local-spec layer dispatches (``tests/projection/test_local_spec.py``)."""
        m, t, e = self.model, self.training, self.e
        mask = (m.seq_length / t.cp) * m.seq_length
        product = CUDA_SOFTMAX_BACKWARD_PRODUCT * scores * (4 if t.attention_softmax_in_fp32 else e)
        if t.attention_softmax_in_fp32:
            return scores * (2 * e + 24) + mask, scores * (2 * e + 28) + mask + product
        return scores * 4 * e + mask, scores * 14 * e + mask + product

    def _local_spec_elements(self, kind: str) -> PassWork:
        """Element-wise passes megatron-core's local spec (``--transformer-impl local``) runs as kernels of their own
        where Transformer Engine folds them into a GEMM or attention kernel (nothing for other backends):

        * ``add_bias_linear``: ``ColumnParallelLinear`` / ``RowParallelLinear`` (``tensor_parallel/layers.py``) run
          ``matmul`` and add the bias in a pass of its own over each linear's output (read and write; with
          ``skip_bias_add`` in the layer's ``bias_dropout_add`` or before the activation); backward, each bias's
          gradient is a sum of the output gradient over the tokens (read it);
        * the context's ``permute(...).contiguous()`` at the end of ``DotProductAttention.forward`` (read and write
          the attention output);
        * backward, ``baddbmm``'s ``alpha`` (the softmax scale) applied to the query and key gradients in a pass
          each, and the gradient of ``get_query_key_value_tensors``'s ``torch.split`` of the fused QKV output: a
          concatenation of the three gradients (read and write);
        * with grouped queries, ``DotProductAttention`` expands the keys and values to every head
          (``repeat_interleave``: read the groups, write the heads), and backward sums each expanded gradient back
          over its heads (read the heads, write the groups); the query, sliced out of the grouped QKV layout, is
          copied by a ``reshape`` forward and its gradient backward (read and write the heads).

        Dense layers only (the local spec's MoE experts are not priced here)."""
        m, t, e = self.model, self.training, self.e
        if t.attention_backend != "local" or kind != "dense":
            return NO_WORK
        heads, groups = m.num_attention_heads / t.tp, m.query_groups / t.tp
        qkv = (heads + 2 * groups) * m.head_dim
        context = self.tokens * heads * m.head_dim * e
        outputs = self.tokens * (qkv + m.ffn / t.tp) * e + 2 * self.hidden_bytes if m.add_bias_linear else 0.0
        grouped = heads > groups  # keys and values expanded, the query copied
        expand = 2 * self.tokens * (heads + groups) * m.head_dim * e + 2 * context if grouped else 0.0
        forward = 2 * outputs + 2 * context + expand
        backward = outputs + 2 * 2 * context + 2 * self.tokens * qkv * e + expand
        return PassWork(Work(memory_bytes=forward), Work(memory_bytes=backward), Work())

    def _ring_corrections(self, v_head_dim: float) -> tuple[float, float]:
        """Bytes ring attention (context parallelism) moves besides its kernels, forward and backward.

        Transformer Engine's ring (``AttnFuncWithCPAndKVP2P``) runs one attention kernel per step of the ring
        and merges each step's partial result into the output in fp32 (``out`` rescaled by the running
        log-sum-exp: read the step's output, read and write the fp32 accumulator); backward accumulates each
        step's dQ, and dK/dV, into fp32 buffers the same way. ``CP`` steps; nothing without CP. The dK/dV
        accumulated are those of the K, V the attention kernel is given: torchtitan's Llama
        (``model_implementation: torchtitan``) repeats the KV heads to the query heads before SDPA (``repeat_kv``),
        and PyTorch's ring keeps ``grad_key`` / ``grad_value`` in fp32 at that shape
        (``_templated_ring_attention_backward``: ``torch.zeros_like(key, dtype=accum_dtype)``)."""
        m, t = self.model, self.training
        if t.cp == 1:
            return 0.0, 0.0
        repeated = m.multi_latent_attention or t.model_implementation == "torchtitan"
        kv_heads = m.num_attention_heads if repeated else m.query_groups
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim if m.multi_latent_attention else m.head_dim
        out = self.tokens * m.num_attention_heads / t.tp * v_head_dim
        dq = self.tokens * m.num_attention_heads / t.tp * qk
        dkv = self.tokens * kv_heads / t.tp * (qk + v_head_dim)
        per_element = self.e + 2 * 4  # the step's result, read; the fp32 accumulator, read and written
        return t.cp * out * per_element, t.cp * (dq + dkv) * per_element

    @property
    def _norm_kernel(self) -> str:
        """The residual stream's norms' kernel (a key of :data:`BACKWARD_BYTES_PER_FORWARD_BYTE`): one fused kernel
        each way, or torchtitan's eager RMSNorm chain (``elementwise_kernels: torchtitan-eager``)."""
        eager = self.training.elementwise_kernels == "torchtitan-eager" and self.model.normalization == "RMSNorm"
        return "rmsnorm_eager" if eager else "norm"

    def _norms(self) -> Work:
        """The layer's two norms, forward: each reads and writes the residual stream, or (torchtitan's eager
        RMSNorm) moves :data:`EAGER_RMSNORM_BYTES` per element."""
        per_element = EAGER_RMSNORM_BYTES[0] if self._norm_kernel == "rmsnorm_eager" else 2 * self.e
        return Work(memory_bytes=2 * per_element * self.hidden_bytes / self.e)

    @property
    def _activation_kernel(self) -> str:
        """The activation's kernel (a key of :data:`BACKWARD_BYTES_PER_FORWARD_BYTE`): a compiled squared ReLU is one
        kernel each way that moves what GELU's does; NeMo 2's eager one (``squared_relu_fusion`` off) is a chain."""
        if self.model.swiglu:
            return "swiglu_eager" if self.training.elementwise_kernels == "torchtitan-eager" else "swiglu"
        return "squared_relu" if self.model.squared_relu and not self.training.squared_relu_fusion else "gelu"

    def _activation(self, tokens: float, width: float) -> Work:
        """The activation function over ``tokens`` x ``width``: SwiGLU reads 2F, writes F (eager, as torchtitan runs it:
        silu, then the product, :data:`EAGER_SWIGLU_BYTES`); GELU (and a compiled squared ReLU) reads F, writes F; an
        eager squared ReLU reads and writes F twice (relu, then pow)."""
        per_element = {"swiglu": 3, "swiglu_eager": EAGER_SWIGLU_BYTES[0] / 2, "gelu": 2,
                       "squared_relu": 4}[self._activation_kernel]
        return Work(memory_bytes=per_element * tokens * width * self.e)

    def _unfused_rope(self) -> PassWork:
        """Rotary embedding of the queries and keys (``X`` elements) where it does not run fused (the fused kernel is
        the ``rope`` entry of :meth:`_elementwise_kernels`). megatron-core's unfused ``_apply_rotary_pos_emb_bshd`` (``rope_utils.py`` lines 92-126 at
        core_v0.15.0, b0cc270 and 55ac708), which runs without ``apply_rope_fusion`` and for YaRN
        (:attr:`~primuspipe.projection.training_spec.RankShape.rope_fused`), is a chain of eager ops: ``t * cos``,
        the rotated half (a negation of one half and a concatenation), ``* sin``, their sum, and a concatenation with
        the empty unrotated part -- 2 + 1 + 2 + 2 + 3 + 2 = 12 ``e`` per element forward; autograd's gradients of the
        two products, the negation and concatenation, the sum of the two branches, and the slices' gradients with
        their sum, 14 backward (held against the aten operations that function dispatches,
        ``tests/projection/test_time_model.py``; the cos and sin of the small frequency table aside). MLA is counted
        apart: :meth:`_mla_rope_elements` prices its rotary, fused or not. torchtitan's complex-number rotary
        (``elementwise_kernels: torchtitan-eager``, or ``model_implementation: torchtitan`` under torch.compile, whose
        inductor leaves complex operators to aten: :attr:`~primuspipe.projection.training_spec.RankShape.rope_fused`)
        moves :data:`EAGER_ROPE_BYTES` instead: its two casts are inductor's kernels under compile, but the fp32 copy
        feeds the complex product and the product's output feeds the cast back, so neither fuses away."""
        m = self.model
        if not m.rotary or self.rope_fused or m.multi_latent_attention:
            return NO_WORK
        t = self.training
        complex_form = t.elementwise_kernels == "torchtitan-eager" or t.model_implementation == "torchtitan"
        forward, backward = EAGER_ROPE_BYTES if complex_form else (12 * self.e, 14 * self.e)
        elements = self._query_key_elements
        return PassWork(Work(memory_bytes=forward * elements), Work(memory_bytes=backward * elements), Work())

    @property
    def _query_key_elements(self) -> float:
        """Elements of one layer's queries and keys on this rank (what rotary embedding and per-head norms touch)."""
        m = self.model
        return self.tokens * (m.num_attention_heads + m.query_groups) / self.training.tp * m.head_dim

    def _elementwise_kernels(self, kind: str) -> dict[str, float]:
        """Forward bytes of one layer's element-wise kernels by kernel (keys of
        :data:`BACKWARD_BYTES_PER_FORWARD_BYTE`): norms, residual adds, rotary embedding, per-head query/key
        norms, the activation functions, MoE permutation and the router's softmax / top-k."""
        m, t = self.model, self.training
        e = self.e
        heads = self._query_key_elements * e
        moved = Counter({self._norm_kernel: self._norms().memory_bytes,
                         "residual_add": 2 * 3 * self.hidden_bytes})  # two adds: 2 reads, 1 write
        if m.multi_latent_attention:  # latent norms; rotary embedding and query/key/value assembly (_mla_elements)
            moved["norm"] += self._mla_norm_elements() * e
            moved["rope"] += self._mla_rope_elements() * e
        elif m.rotary and self.rope_fused:  # else :meth:`_unfused_rope`
            moved["rope"] += 2 * heads
        if m.qk_layernorm and not m.multi_latent_attention:  # per-head norms read and write the queries and keys
            moved["norm"] += 2 * heads
        if kind == "dense":
            moved[self._activation_kernel] += self._activation(self.tokens, m.ffn / t.tp).memory_bytes
            return moved
        copies = self.routed_copies
        scattered = self.accumulating_scatters(kind).forward.scatter_add_bytes  # priced apart
        moved["permute"] += 4 * copies * m.hidden_size * e * self.permutations - scattered
        if not t.fake_balanced_gate:  # AutoModel's fake gate computes no logits (FakeBalancedGate: arange, ones)
            moved["router"] += self.residual_tokens * m.num_experts * 4 * 3  # softmax / top-k over fp32 logits
        shared = self._activation(self.tokens, (m.moe_shared_expert_intermediate_size or 0) / t.tp)
        moved[self._activation_kernel] += (self._activation(copies, m.expert_ffn / t.etp) + shared).memory_bytes
        return moved

    def _elementwise(self, kind: str) -> PassWork:
        """One layer's element-wise kernels, forward and backward (:meth:`_elementwise_kernels`)."""
        return _elementwise_pass(self._elementwise_kernels(kind))

    def _mla_elements(self) -> float:
        """Elements MLA's element-wise kernels read and write in one layer's forward besides its GEMMs (megatron-core
        0.19's ``MLASelfAttention.get_query_key_value_tensors``): the two latent norms (``q_layernorm`` over the
        query latent, ``kv_layernorm`` over the key/value latent, on the :attr:`latent_tokens`; read and write), then
        :meth:`_mla_rope_elements`."""
        return self._mla_norm_elements() + self._mla_rope_elements()

    def _mla_norm_elements(self) -> float:
        """Of :meth:`_mla_elements`, the two latent norms'."""
        m = self.model
        return 2 * self.latent_tokens * ((m.q_lora_rank or 0) + m.kv_lora_rank)

    @property
    def latent_tokens(self) -> float:
        """Tokens MLA's down-projections and latent norms see on this rank: the sequence-parallel shard."""
        return self.tokens / self.training.tp if self.training.sp else self.tokens

    def _mla_rope_elements(self) -> float:
        """Of :meth:`_mla_elements`, what follows the up-projections (``qkv_up_proj_and_rope_apply``, which
        ``mla_up_proj`` recompute re-runs with them): per head, the rotary part of the query and the shared rotary
        key rotated and the query, key and value assembled for the attention kernel (TE's fused attention takes
        them contiguous):

        * with ``apply_rope_fusion`` (``fusions/fused_mla_yarn_rope_apply.py``): ``fused_apply_mla_rope_for_q``
          rotates the query's rotary slice in place (read and write ``r`` per head); ``fused_apply_mla_rope_for_kv``
          reads the up-projected ``kv`` (``d_qk + d_v`` per head) and the rotary key and writes the key
          (``d_qk + r``) and the value (``d_v``);
        * without it (``rope_utils._apply_rotary_pos_emb_bshd`` with ``mla_rotary_interleaved``): the query's and
          the key's rotary slices pass through seven element-wise ops each (the interleaving ``cat``, ``* cos``,
          ``rotate_half``'s negation and ``cat``, ``* sin``, the sum, the ``cat`` with the empty pass-through part:
          14 element reads and writes per rotary element), then ``torch.cat`` builds the query
          (``d_qk + r`` read and written per head) and the key (the key slice of ``kv`` and the broadcast rotary
          key, ``d_qk + r`` each way), and ``value.contiguous()`` copies the value out of ``kv`` (``d_v`` each way).
        """
        m, t = self.model, self.training
        heads, tokens = m.num_attention_heads / t.tp, self.tokens
        qk, rope, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        if t.apply_rope_fusion:
            return tokens * (heads * (2 * rope + (qk + v) + (qk + rope) + v) + rope)
        return tokens * (heads * (14 * rope + 2 * (qk + rope) + 2 * (qk + rope) + 2 * v) + 14 * rope)

    @property
    def permutations(self) -> int:
        """Times every token copy is permuted and unpermuted (each a read and a write of it) per MoE layer:
        once into expert order before the dispatch; megatron-core's all-to-all dispatcher permutes the
        received copies a second time, from source-rank order into local-expert order, when a rank holds
        more than one expert, and undoes that before the combine (``MoEAlltoAllTokenDispatcher``'s
        ``dispatch_postprocess`` / ``combine_preprocess``: ``sort_chunks_by_idxs``, or a transposing
        copy when padded to capacity). HybridEP (the flex dispatcher's ``hybridep`` backend) permutes none
        apart: megatron-core's ``_HybridEPManager`` returns the dispatched rows as they come
        (``get_permuted_hidden_states_by_experts`` / ``get_restored_hidden_states_by_experts`` pass them through),
        because its ``HybridEPDispatch`` / ``HybridEPCombine`` call DeepEP hybrid-ep's ``dispatch_with_permute`` /
        ``combine_with_unpermute`` ("permute + dispatch a2a + permute", ``fused_a2a.py`` at the Megatron-LM commit
        Megatron-Bridge 26.02.01 pins, 55ac708): the copy out of its receive buffer writes expert order (DeepEP's
        ``deep_ep/hybrid_ep_buffer.py``, ``dispatch_with_permute``: "If we use permute kernel, the output tensor
        will be permuted. the result can be directly used in the gemm"; ``csrc/hybrid_ep/extension/permute.cu``),
        and :func:`~primuspipe.projection.comm.layer_comm` prices that copy with the all-to-all."""
        t = self.training
        if t.hybridep:
            return 0
        second = t.moe_token_dispatcher_type == "alltoall" and t.ep > 1 and self.model.num_experts // t.ep > 1
        return 2 if second else 1

    def accumulating_scatters(self, kind: str) -> PassWork:
        """The accumulating scatters of megatron-core's unfused MoE permutation (``moe_permute_fusion`` off; the
        all-to-all and DeepEP dispatchers alike, ``moe_utils.permute`` / ``unpermute`` at the Megatron-LM commit
        Primus pins, 84778176): ``unpermute`` returns the copies to token order with ``scatter_add_`` forward, and
        ``permute``'s ``index_select`` has ``index_add_`` as its backward; each adds every copy's row into its
        token's (a token's ``k`` copies meet in one row, so they cannot be plain stores). Of the permutation's
        traffic (:attr:`permutations`) these are the unpermutation's forward half and the permutation's
        backward half; Transformer Engine's fused kernels (``moe_unpermute`` and the fused permutation's
        backward) reduce a token's copies in registers and store once, so with fusion there are none."""
        t, m = self.training, self.model
        if kind != "moe" or t.moe_permute_fusion or t.hybridep:  # HybridEP: no permutation apart (permutations)
            return NO_WORK
        elements = self.routed_copies * m.hidden_size
        scatter = Work(scatter_add_elements=elements, scatter_add_bytes=2 * elements * self.e)
        return PassWork(scatter, scatter, Work())

    @property
    def probs_bytes(self) -> int:
        """Bytes of one routing probability as the experts receive it: DeepEP and HybridEP (the flex dispatcher)
        take fp32 probabilities only, and megatron-core casts them (``MoEFlexTokenDispatcher``: "HybridEP only
        supports float32 probs"); the other dispatchers pass the router's dtype on."""
        t = self.training
        if t.moe_token_dispatcher_type == "flex":
            return 4
        return {"fp32": 4, "fp64": 8}.get(t.moe_router_dtype or "", self.e)

    def _expert_output_bias(self) -> PassWork:
        """The experts' second bias (``add_bias_linear``), which megatron-core's ``TEGroupedMLP`` adds outside the
        grouped GEMM (``skip_bias_add``, then ``_apply_bias``): per local expert the bias times each copy's
        probability plus that expert's slice of the output, then one concatenation and a cast back. Each step
        is an element-wise pass over the ``copies x H`` output in the promoted dtype ``r`` of the activations and
        the probabilities: forward ``b*p`` written, the sum read and written, the concatenation read and
        written, the cast read and written (none when ``r`` is the activations' dtype); backward the casts'
        gradients, and per factor of ``b*p`` a product written and read back for its reduction (the bias's
        gradient over the tokens, the probability's over ``H``)."""
        e, r = self.e, max(self.e, self.probs_bytes)
        elements = self.routed_copies * self.model.hidden_size
        casts = (r + e) if r != e else 0
        forward = r + (e + 2 * r) + 2 * r + casts
        backward = 2 * casts + 2 * 3 * r
        return PassWork(Work(memory_bytes=forward * elements), Work(memory_bytes=backward * elements), Work())

    def _expert_input_bias(self) -> PassWork:
        """The experts' first bias where the grouped GEMM does not add it (``expert_kernels: automodel-deepep``:
        ``ops.gmm`` has no bias, AutoModel's ``_apply_bias`` adds it): per local expert the bias plus that expert's
        slice of the first linear's output (``copies x 2F`` with a gated activation), then one concatenation, in
        the activations' dtype (no probabilities, no cast): forward the sum and the concatenation each read and
        written, backward the bias's gradient, a reduction over the copies that reads the output gradient once (the
        concatenation's and the sum's gradients pass through as views). megatron-core adds it in the grouped GEMM:
        nothing here."""
        m, t, e = self.model, self.training, self.e
        if t.expert_kernels != "automodel-deepep":
            return NO_WORK
        elements = self.routed_copies * (2 if m.swiglu else 1) * m.expert_ffn / t.etp
        return PassWork(Work(memory_bytes=4 * e * elements), Work(memory_bytes=e * elements), Work())

    def _fp8_padding(self) -> PassWork:
        """The experts' FP8 padding copies (:attr:`~primuspipe.projection.training_spec.RankShape.fp8_padding_copies`) as memory traffic: forward, the token copies
        read and written into the padded buffer and the second linear's output read and written back out of it,
        and the routing probabilities padded likewise; backward, the same copies of the gradients the other way.
        The padding rows themselves (fewer than the alignment per expert) are not counted in the GEMMs."""
        if not self.fp8_padding_copies:
            return NO_WORK
        copies = self.routed_copies
        moved = 2 * 2 * copies * self.model.hidden_size * self.e + 2 * copies * self.probs_bytes
        return PassWork(Work(memory_bytes=moved), Work(memory_bytes=moved), Work())

    def _grad_accumulation(self, params: ParamCount) -> Work:
        """The W pass's adds of fresh weight gradients into their main gradients, for the part's ``params`` on the
        rank: one element-wise pass each (megatron-core's DDP backward hook, ``param.main_grad.add_(param.grad.data)``)
        reading the gradient in the parameters' dtype and reading and writing the main gradient. Every weight
        without ``gradient_accumulation_fusion``; with it only the legacy ``GroupedMLP``'s expert weights (its GEMMs
        cannot accumulate in place); the rest accumulate inside their weight-gradient GEMMs."""
        t = self.training
        unfused = params.total if not t.gradient_accumulation_fusion else params.expert if t.legacy_grouped_mlp else 0
        return Work(memory_bytes=unfused * (self.e + 2 * t.main_grad_bytes))

    def _fsdp2_copies(self, params: float, *, root: bool = False) -> PassWork:
        """FSDP2's copies of ``params`` gathered parameters on the compute stream, once a microbatch
        (:attr:`TrainingSpec.fsdp2_copies`): the all-gather copy-out reads the gathered buffer and writes the
        parameters (the gathered dtype each way: bf16, or one byte under a float8 all-gather), in F and, where
        the layer was resharded after its forward, again in B; the reduce-scatter copy-in reads the bf16 gradients
        and writes the reduce dtype's buffer (fp32 unless told otherwise), in W. ``root``: the root unit's
        (embedding, final norm, output layer), which FSDP2 does not reshard after the forward and whose weights
        are never float8-gathered."""
        t = self.training
        if not t.fsdp2_copies:
            return NO_WORK
        resharded = t.fsdp_reshard_after_forward and not root
        copy_out = Work(memory_bytes=2 * (self.e if root else gathered_weight_bytes(t)) * params)
        copy_in = Work(memory_bytes=(self.e + t.main_grad_bytes) * params)
        return PassWork(copy_out, copy_out if resharded else Work(), copy_in)

    def _expert_clamp(self) -> PassWork:
        """The clamp of the experts' gated activation (``activation_func_clamp_value``, GPT-OSS), which megatron-core
        runs as eager element-wise ops outside its fused activation kernel over the first expert linear's
        ``copies x 2F`` output (``weighted_bias_quick_geglu_impl`` in ``megatron/core/fusions/fused_bias_geglu.py``,
        lines 410-442, the same at core_v0.15.0, core_v0.16.0 and the Megatron-LM commit 55ac708 that
        Megatron-Bridge 26.02.01 pins; the unfused path, ``glu`` in ``TEGroupedMLP.forward``, clamps the same halves
        without the concatenation). Bytes per element of one half (``copies x F``), ``e`` the activations' dtype:

        * forward: the gate half clamped from above and the linear half from both sides, each read and written
          (4e), and with ``bias_activation_fusion`` the two concatenated into the fused kernel's input (4e);
        * backward (autograd's ``clamp_backward``): the gate half's mask (read e, write a 1-byte bool) and the
          ``where`` that applies it (read the mask and the gradient, write it: 1 + 2e); the linear half's two masks,
          their ``logical_and_`` (read 2, write 1) and its ``where``; then ``chunk``'s gradient, a concatenation of
          the two halves' gradients (read 2e, write 2e): 11e + 8.

        Held against the aten operations megatron-core's own function dispatches (``tests/projection/
        test_time_model.py``). A recompute of ``moe_act`` repeats the forward's (the checkpoint reruns the whole
        function)."""
        m, t, e = self.model, self.training, self.e
        if m.activation_func_clamp_value is None or t.expert_kernels == "automodel-deepep":  # compiled with the GLU
            return NO_WORK
        elements = self.routed_copies * m.expert_ffn / t.etp
        forward = 4 * e + (4 * e if t.bias_activation_fusion else 0)
        backward = 11 * e + 8
        return PassWork(Work(memory_bytes=forward * elements), Work(memory_bytes=backward * elements), Work())

    @property
    def expert_copies(self) -> float:
        """Token copies the experts of one rank process per microbatch (uniform routing)."""
        return self.residual_tokens * self.model.moe_router_topk * self.training.etp

    @property
    def routed_copies(self) -> float:
        """Token copies the busiest rank's experts process per microbatch: :attr:`expert_copies` times the
        load imbalance (the set figure, or forced balance's random excess), which every MoE layer waits for."""
        return self.expert_copies * self.load_imbalance

    def layer(self, kind: str) -> PassWork:
        """One layer of ``kind``: GEMMs, attention and element-wise work, with what selective recompute repeats."""
        m, t = self.model, self.training
        attention, up_projections = self._attention_projections()
        core = self._attention_core()
        if kind == "dense":
            mlp = self._mlp(self.tokens, m.ffn / t.tp, dense=True)
            mlp_recompute = mlp.forward if t.recomputes("mlp") else Work()
        else:
            local = m.num_experts // t.ep
            per_expert = self.expert_copies * t.load_imbalance / local
            spread = self.load_imbalance / t.load_imbalance  # forced balance's random excess (Gemm.stretch)
            routed = self._mlp(per_expert, m.expert_ffn / t.etp, groups=local, stretch=spread, fp8=t.experts_fp8)
            shared = (self._mlp(self.tokens, m.moe_shared_expert_intermediate_size / t.tp)
                      if m.moe_shared_expert_intermediate_size else None)
            router = (NO_WORK if t.fake_balanced_gate  # AutoModel's fake gate has no GEMM
                      else self._linear(self.residual_tokens, m.hidden_size, m.num_experts, fp8=False))
            bias = [self._expert_input_bias(), self._expert_output_bias()] if m.add_bias_linear else []
            clamp = self._expert_clamp()
            mlp = _sum(routed, self._fp8_padding(), router, clamp, *bias, *([shared] if shared else []))
            mlp_recompute = (mlp.forward if t.recomputes("moe") else
                             shared.forward if shared and t.recomputes("shared_experts") else Work())
            if t.recomputes("moe_act") and not t.recomputes("moe"):
                act = self._activation(self.routed_copies, m.expert_ffn / t.etp)
                mlp_recompute = mlp_recompute + act + clamp.forward
        element = _sum(self._elementwise(kind), self._unfused_rope(), self.accumulating_scatters(kind),
                       self._local_spec_elements(kind), self._hidden_dropout(sites=2))
        params = sum(layer_params(m, t, kind).values(), ParamCount())
        accumulate = self._grad_accumulation(params)
        copies = self._fsdp2_copies(params.total)
        forward = attention.forward + core.forward + mlp.forward + element.forward + copies.forward
        recompute = (self._op_recompute(kind) if t.recompute_granularity == "op" else
                     (core.recompute if t.recomputes("core_attn") else Work()) + mlp_recompute
                     + (self._norms() if t.recomputes("layernorm") else Work())
                     + (up_projections.forward + Work(memory_bytes=self._mla_rope_elements() * self.e)
                        if t.recomputes("mla_up_proj") and m.multi_latent_attention else Work()))
        backward_input = (attention.backward_input + core.backward_input + mlp.backward_input + element.backward_input
                          + copies.backward_input)
        return PassWork(forward, backward_input, attention.backward_weight + mlp.backward_weight + accumulate
                        + copies.backward_weight, recompute)

    def _op_recompute(self, kind: str) -> Work:
        """What torchtitan's op recompute reruns of one block's forward before its backward: the GEMMs whose outputs
        its policy does not save (:func:`~primuspipe.projection.activations.op_gemms`: wk, wo, w3), with their FP8
        casts, and the element-wise kernels (norms, rotary embedding, the activation, the residual add that makes
        the MLP's input); not the block's last residual add, which the backward needs nothing of (eager
        checkpointing stops its recompute once the last tensor the backward needs is rebuilt, and the compiler's
        partitioner recomputes only what the backward reads). The saved GEMMs and the attention kernel are not rerun.
        Sequence parallelism's all-gathers, also recomputed, are not priced here."""
        gemms = [self._linear(self.tokens, gemm_width(self, fan_in), gemm_width(self, fan_out),
                              norm_fed=fan_in == "hidden",
                              tensor_parallel="column" if fan_in == "hidden" else "row")
                 for _, fan_in, fan_out, saved in op_gemms(self.model.swiglu) if not saved]
        moved = self._elementwise_kernels(kind)
        moved["residual_add"] /= 2
        return _sum(*gemms).forward + _elementwise_pass(moved).forward + self._unfused_rope().forward

    def embedding(self, shared: bool = False) -> PassWork:
        """Token (and position) lookup: memory-bound; its gradient, a scatter-add, runs in B (split-backward
        runners do not defer it), with the weight gradient it lands in (:meth:`_embedding_weight_gradient`;
        ``shared``: a second lookup of the same tables, a multi-token-prediction module's)."""
        moved = self.hidden_bytes
        # the root's copy-out; its gradient's copy-in stands in the add into the main gradient counted below
        gathered = NO_WORK if shared else PassWork(
            self._fsdp2_copies(embedding_params(self.model, self.training.tp), root=True).forward, Work(), Work())
        return _sum(PassWork(Work(memory_bytes=moved), Work(memory_bytes=2 * moved), Work()), gathered,
                    self._hidden_dropout(sites=1, alone=True), self._embedding_weight_gradient(shared))

    def _embedding_weight_gradient(self, shared: bool = False) -> PassWork:
        """The embedding tables' weight gradient, made whole every microbatch, in B. ``F.embedding``'s backward
        (``embedding_dense_backward`` on a GPU: ``embedding_backward_cuda_kernel`` in PyTorch's
        ``aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu``) allocates the gradient of the whole table with
        ``at::zeros`` (a write of ``e`` a parameter) and adds only the looked-up rows into it (the scatter-add
        :meth:`embedding` counts); no ``gradient_accumulation_fusion`` reaches it (that fusion is the linear
        layers' weight-gradient GEMM), so megatron-core's DDP backward hook adds it into the main gradient
        (``param.main_grad.add_(param.grad.data)``: read ``e``, read and write the main gradient), as
        :meth:`_grad_accumulation` counts for unfused weights. The rank's vocabulary shard and learned positions
        (:func:`~primuspipe.projection.parameters.embedding_params`). ``shared``: a second lookup of the same
        tables (megatron-core's multi-token prediction reuses the model's embedding) makes its own zeroed table,
        which autograd sums with the first before the parameter's one accumulation (read two, write one): ``4e``."""
        params = embedding_params(self.model, self.training.tp)
        per_param = 4 * self.e if shared else self.e + self.e + 2 * self.training.main_grad_bytes
        return PassWork(Work(), Work(memory_bytes=params * per_param), Work())

    def _hidden_dropout(self, sites: int, alone: bool = False) -> PassWork:
        """What ``hidden_dropout`` adds over the residual stream's ``T_r x H`` elements at each of ``sites``. In a
        layer (two sites: after attention and after the MLP) it runs inside megatron-core's fused
        ``bias_dropout_add`` (``bias_dropout_add_fused_train``, ``jit_fuser``: ``torch.compile`` from torch 2.2),
        whose forward already reads and writes the stream (the ``residual_add`` of :meth:`_elementwise_kernels`):
        dropout adds the one-byte keep mask it writes for backward (the mask :mod:`~primuspipe.projection.activations`
        keeps), and a backward pass of its own that applies the mask to the gradient (read ``e`` and the mask,
        write ``e``; with dropout 0 the gradient passes through the adds untouched, no kernel). ``alone``: the
        embedding's ``torch.nn.Dropout`` (``LanguageModelEmbedding.embedding_dropout``, after the sequence-parallel
        scatter), a kernel of its own, ``native_dropout`` forward (read ``e``, write ``e`` and the mask) and
        ``native_dropout_backward``. Nothing with ``hidden_dropout`` 0 (PyTorch's ``dropout`` returns its input at
        ``p == 0``)."""
        if self.model.hidden_dropout == 0:
            return NO_WORK
        elements = sites * self.residual_tokens * self.model.hidden_size
        forward = self._native_dropout_bytes if alone else MASK_BYTES
        return PassWork(Work(memory_bytes=elements * forward), Work(memory_bytes=elements * self._native_dropout_bytes),
                        Work())

    def head(self) -> PassWork:
        """Final norm, output layer and the vocab-parallel cross entropy."""
        m, t = self.model, self.training
        vocab = m.padded_vocab(t.tp) / t.tp
        output = self._linear(self.tokens, m.hidden_size, vocab, fp8=False)  # Megatron keeps the output layer in bf16
        forward, backward = self._loss_bytes_per_logit()
        logits = self.tokens * vocab
        norm = _elementwise_pass({self._norm_kernel: self._norms().memory_bytes / 2})  # the final norm
        copies = self._fsdp2_copies(head_params(m, t.tp), root=True)
        return PassWork(output.forward + Work(memory_bytes=logits * forward) + norm.forward + copies.forward,
                        output.backward_input + Work(memory_bytes=logits * backward) + norm.backward_input,
                        output.backward_weight + self._grad_accumulation(ParamCount(head_params(m, t.tp)))
                        + copies.backward_weight)

    def _loss_bytes_per_logit(self) -> tuple[float, float]:
        """Bytes the vocab-parallel cross entropy moves per logit of the rank's vocabulary shard, forward and
        backward. Unfused (megatron-core's ``VocabParallelCrossEntropy``, ``tensor_parallel/cross_entropy.py``, the
        same at core_r0.8.0 and 0.19): forward, ``calculate_logits_max`` casts the logits to fp32 (read ``e``, write
        4) and takes their maximum (read 4); ``calculate_predicted_logits`` subtracts it in place (read 4, write 4)
        and exponentiates in place (``torch.exp(x, out=x)``: 8) and sums (read 4); ``calculate_cross_entropy_loss``
        divides in place by the sum (8): ``e + 36``. Backward, ``calculate_gradients``' in-place product with the
        loss gradient (8) and autograd's cast of the fp32 gradient back to the logits' dtype (``4 + e``):
        ``e + 12``. With fp32 logits neither cast runs (``.float()`` returns its input): 32 and 8. The picks of
        each token's target logit touch one logit a token (not counted). Held against the aten operations
        megatron-core's functions dispatch (``tests/projection/test_dropout_and_loss.py``).

        Fused (``cross_entropy_loss_fusion``), ``native`` (megatron-core's ``fused_vocab_parallel_cross_entropy``,
        ``fusions/fused_cross_entropy.py``, the same at core_r0.8.0, core_r0.11.0 and 0.19): the unfused
        functions run as four ``@jit_fuser`` (``torch.compile``) regions, forward three with the TP all-reduces
        between them, so at best one kernel each, reading every logit-sized input once and writing every
        logit-sized output or input it mutates once: ``calculate_logits_max`` reads the logits and writes their
        fp32 copy (``e + 4``; ``.float()`` returns fp32 logits themselves: ``e``), ``calculate_predicted_logits``
        subtracts the maximum and exponentiates in place (8), ``calculate_cross_entropy_loss`` divides in place
        (8): ``e + 20``; backward ``calculate_gradients`` reads the saved fp32 softmax, writes it back (the
        in-place product with the loss gradient mutates its input) and writes the gradient, hard-cast to bf16:
        10, plus autograd's cast of that gradient back for logits of another dtype (read 2, write ``e``).
        ``te`` (Transformer Engine's ``parallel_cross_entropy``, ``pytorch/triton/cross_entropy.py`` from 2.7):
        ``online_softmax_kernel`` reads the logits, ``cross_entropy_kernel`` reads them again and writes the
        gradient in place in their dtype, and backward ``element_mul_kernel`` scales it in place: ``3e`` and
        ``2e``.

        PyTorch's ``F.cross_entropy`` (``torch_cross_entropy``, NeMo AutoModel's ``MaskedCrossEntropy``) is
        ``log_softmax`` then ``nll_loss``: forward, the log-softmax reads the logits and writes its output (``2c``,
        ``c`` the bytes of the dtype it runs in: 4 under ``fp32_upcast``, else ``e``), after the upcast's cast
        (read ``e``, write 4) where there is one; the loss picks one element a row (not counted). Backward,
        ``nll_loss_backward`` writes a zero-filled gradient of the logits' size with one element a row set (``c``),
        ``_log_softmax_backward_data`` reads it and the saved output and writes the input gradient (``3c``), and
        autograd casts that back (read 4, write ``e``) after an upcast: ``2c`` (+ ``e + 4``) and ``4c``
        (+ ``e + 4``) -- 4 and 8 bytes a bf16 logit without the upcast, 14 and 22 with it, against megatron-core's
        unfused 38 and 14."""
        e = self.e
        if self.training.torch_cross_entropy is not None:
            upcast = e + 4 if self.training.torch_cross_entropy == "fp32" and e < 4 else 0
            c = 4 if self.training.torch_cross_entropy == "fp32" else e
            return upcast + 2 * c, upcast + 4 * c
        cast = e + 4 if e < 4 else 0
        if self.training.cross_entropy_loss_fusion and self.training.cross_entropy_fusion_impl == "te":
            return 3 * e, 2 * e
        if self.training.cross_entropy_loss_fusion:
            bf16 = e == 2 and self.training.precision != "fp16"
            return (cast or e) + 16, 10 + (0 if bf16 else 2 + e)
        return cast + 32, cast + 8

    def mtp(self) -> PassWork:
        """One multi-token-prediction module: embedding lookup, two norms, the 2H -> H projection, a layer
        of the last layer's kind and another pass through the output layer and loss."""
        m = self.model
        projection = self._linear(self.tokens, 2 * m.hidden_size, m.hidden_size)
        return _sum(self.embedding(shared=True), projection, self.layer(m.layer_kinds[-1]), self.head(),
                    _elementwise_pass({self._norm_kernel: self._norms().memory_bytes}))

    def part(self, name: str) -> PassWork:
        return {"embedding": self.embedding, "head": self.head, "mtp": self.mtp}.get(name, lambda: self.layer(name))()

    def model_flops(self, attention: str = "causal") -> float:
        """Model FLOPs of one microbatch on one rank, all three passes, no recompute (MFU's numerator):
        GEMMs, and attention counted by ``attention`` (see :data:`FLOP_CONVENTIONS`)."""
        core = self._attention_core()  # the local backend's are GEMMs: counted below by the convention instead
        core_gemms = sum(w.gemm_flops for w in core.passes())

        def useful(work: PassWork, attention_flops: float) -> float:
            return sum(w.gemm_flops for w in work.passes()) + attention_flops * 3

        square = self._attention_square()  # the full convention counts the square in every layer, windowed or not
        counted = square if attention == "full" else 0.5 * square * self.window_share
        layers = Counter(self.model.layer_kinds)
        return (sum(n * (useful(self.layer(k), counted) - core_gemms) for k, n in layers.items())
                + useful(self.head(), 0))


def model_flops_per_token(model: ModelSpec, attention: str = "causal") -> float:
    """Model FLOPs (three passes) per token of the whole model, attention counted by ``attention``."""
    neutral = TrainingSpec(pipeline_model_parallel_size=1, global_batch_size=1)
    return WorkModel(model, neutral).model_flops(attention) / model.seq_length


def _elementwise_pass(forward_bytes: Mapping[str, float]) -> PassWork:
    """Element-wise kernels' forward and input-gradient traffic from their forward bytes by kernel."""
    forward = sum(forward_bytes.values())
    backward = sum(b * BACKWARD_BYTES_PER_FORWARD_BYTE[k] for k, b in forward_bytes.items())
    return PassWork(Work(memory_bytes=forward), Work(memory_bytes=backward), Work())


def _sum(*works: PassWork) -> PassWork:
    return PassWork(*(sum((w.passes()[i] for w in works), Work()) for i in range(3)))


@dataclass(frozen=True)
class PartTimes:
    """Seconds of each pass of one part, and what its selective recompute adds to B."""

    forward: float
    backward_input: float
    backward_weight: float
    recompute: float = 0.0
    gemm: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of each pass, the seconds of GEMMs (what TP communication can hide under)."""
    attention: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of each pass, the seconds of the attention kernels (what ring attention hides its transfers under)."""
    host: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of each pass, the host's seconds issuing it (:mod:`~primuspipe.projection.host`; 0 where not modelled)."""
    host_syncs: bool = False
    """The forward waits for the GPU once (a device-to-host copy of token counts)."""


@dataclass(frozen=True)
class Calibration:
    """Measured / analytical time factors per part and pass; a missing entry is 1 (no correction)."""

    factors: dict[tuple[str, str], float] = field(default_factory=dict)
    """``(part, pass) -> factor``; part is one of :data:`PARTS`, pass one of :data:`PASSES`."""
    source: str = "analytical"
    """What the factors were measured from (shown in reports)."""

    def factor(self, part: str, pass_name: str) -> float:
        return self.factors.get((part, pass_name), 1.0)


def part_times(work: WorkModel, hardware: HardwareSpec, calibration: Calibration) -> dict[str, PartTimes]:
    """Seconds per pass of every part the model has, analytical times scaled by the calibration."""
    precision = work.training.precision
    hardware = hardware.with_attention_kernel(work.training.attention_kernel, work.training.source)
    check_runs_on(work.training, hardware)
    parts = [p for p in PARTS if p in work.model.layer_kinds or p in ("embedding", "head")
             or (p == "mtp" and work.training.mtp_num_layers)]

    length = work.model.seq_length / work.training.cp  # queries per attention kernel (per ring step under CP)
    head_dim = work.head_dims[0]

    def timed(pw: PassWork, part: str, fp8: bool | None = None) -> PartTimes:
        factors = [calibration.factor(part, name) for name in PASSES]
        fixed = [0.0 if (part, name) in calibration.factors else k  # a measured factor includes them
                 for name, k in zip(PASSES, kernel_overheads(work, hardware, part, fp8))]
        seconds = [w.seconds(hardware, precision, length, head_dim, name != "forward") * f + k
                   for w, f, k, name in zip(pw.passes(), factors, fixed, PASSES)]
        recompute = (pw.recompute.seconds(hardware, precision, length, head_dim) * calibration.factor(part, "forward")
                     + (fixed[0] if part == "moe" and work.training.recomputes("moe") else 0.0))
        gemm = tuple(w.gemm_seconds(hardware, precision) * f for w, f in zip(pw.passes(), factors))
        attention = tuple(w.attention_seconds(hardware, precision, length, head_dim, name != "forward") * f
                          for w, f, name in zip(pw.passes(), factors, PASSES))
        if part not in ("dense", "moe") or not host_priced(hardware, work.training, part):
            return PartTimes(*seconds, recompute, gemm, attention)
        host = layer_host(work.model, work.training, part, fp8)
        return PartTimes(*seconds, recompute, gemm, attention, host.seconds(hardware), host.syncs)

    times = {part: timed(work.part(part), part) for part in parts}
    bf16 = work.training.bf16_layers(work.model.num_layers)
    if bf16:
        plain = WorkModel(work.model, work.training.without_fp8())
        for kind in {work.model.layer_kinds[i] for i in bf16}:
            times[layer_part(kind, True)] = timed(plain.layer(kind), kind, fp8=False)
    return times


def kernel_overheads(work: WorkModel, hardware: HardwareSpec, part: str, fp8: bool | None = None
                     ) -> tuple[float, float, float]:
    """Seconds an MoE layer's small kernels add to each pass beyond their modelled work
    (``moe_kernel_seconds`` per kernel of :func:`~primuspipe.projection.host.moe_small_kernels`, and
    ``stream_launch_gap_seconds`` more per kernel the host launches into a stream rather than a CUDA graph
    replays, :func:`~primuspipe.projection.host.moe_stream_kernels`); nothing for other parts or where the
    hardware file does not give ``moe_kernel_seconds``. A pass with a measured calibration factor does not add
    them: the measurement already holds them."""
    if part != "moe" or hardware.moe_kernel_seconds is None:
        return 0.0, 0.0, 0.0
    kernels = moe_small_kernels(work.model, work.training, fp8)
    streamed = moe_stream_kernels(work.model, work.training, fp8)
    gap = hardware.stream_launch_gap_seconds or 0.0
    return tuple(n * hardware.moe_kernel_seconds + s * gap for n, s in zip(kernels, streamed))  # type: ignore[return-value]


def layer_part(kind: str, bf16: bool) -> str:
    """The :func:`part_times` entry of a layer of ``kind``: its own, or its BF16 twin for a layer that
    ``first_last_layers_bf16`` keeps out of FP8."""
    return f"{kind}:bf16" if bf16 else kind


def optimizer_seconds(local_params: float, hardware: HardwareSpec) -> float:
    """Adam's step over the parameters a rank updates: memory-bound, reading the fp32 gradient, master
    weight and two moments (16 bytes) and writing the last three and the bf16 weight (14 bytes)."""
    return local_params * 30 / (hardware.hbm_bandwidth_bytes_per_s * hardware.memory_bandwidth_fraction)
