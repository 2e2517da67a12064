"""Compute time of every pass (F, B, W) of every part of the model on one rank, for one microbatch.

Work is counted per rank as in Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM"): a GEMM over ``n`` tokens with a weight of ``p`` elements costs
``2 n p`` FLOPs forward, the same again for the input gradient (B, "dgrad") and for the weight gradient
(W, "wgrad"). Attention scores and their use (``QK^T`` and ``PV``) cost ``2 * 2 b (s/CP) s a d / TP``
forward; causal masking halves that for flash attention, which skips masked tiles (the unfused kernel
computes the full square), and the model FLOPs behind MFU count the causal half. Their backward is in
B: twice the forward (two GEMMs per forward GEMM), 2.5 times with flash attention, which recomputes
the scores (Dao 2022, "FlashAttention-2"). Element-wise kernels (norms, residual adds, rotary
embedding, the activation function, the unfused softmax, MoE permutation) are memory-bound: each
reads its inputs and writes its output once, forward; twice that backward, in B.

Times: GEMM and attention FLOPs at ``peak * achievable_fraction`` (half of it in fp32), element-wise
bytes at ``HBM bandwidth * memory_bandwidth_fraction``. Recompute re-runs forward work in B: a whole
layer's under full recompute, the recomputed modules' under selective recompute.

A :class:`Calibration` scales these analytical times by measured factors, per part and pass: from
the layer benchmark (real megatron-core layers timed on the local device) or from a run's dump.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.parameters import attention_params, layer_params
from primuspipe.projection.training_spec import RankShape

PASSES = ("forward", "backward_input", "backward_weight")
PARTS = ("dense", "moe", "embedding", "head")
"""The parts the model is timed in: a layer of each kind, the first stage's extra and the last's."""


@dataclass(frozen=True)
class Work:
    """What one pass of one part does on one rank."""

    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    memory_bytes: float = 0.0
    """Bytes moved by element-wise (memory-bound) kernels."""

    def __add__(self, other: Work) -> Work:
        return Work(self.gemm_flops + other.gemm_flops, self.attention_flops + other.attention_flops,
                    self.memory_bytes + other.memory_bytes)

    def scaled(self, factor: float) -> Work:
        return Work(self.gemm_flops * factor, self.attention_flops * factor, self.memory_bytes * factor)

    def seconds(self, hardware: HardwareSpec, precision: str) -> float:
        flops_per_s = hardware.peak_bf16_tflops * 1e12 * hardware.achievable_fraction * (0.5 if precision == "fp32" else 1)
        bytes_per_s = hardware.hbm_bandwidth_bytes_per_s * hardware.memory_bandwidth_fraction
        return (self.gemm_flops + self.attention_flops) / flops_per_s + self.memory_bytes / bytes_per_s


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


@dataclass(frozen=True)
class WorkModel(RankShape):
    """Per-rank work of each part of the model for one microbatch."""

    def _gemm(self, tokens: float, weights: float) -> PassWork:
        flops = 2 * tokens * weights
        return PassWork(Work(flops), Work(flops), Work(flops))

    def _attention_core(self) -> PassWork:
        m, t = self.model, self.training
        qk, v = ((m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim) if m.multi_latent_attention
                 else (m.head_dim, m.head_dim))
        square = 2 * t.micro_batch_size * (m.seq_length / t.cp) * m.seq_length * m.num_attention_heads / t.tp * (qk + v)
        causal = 0.5 * square
        forward = causal if t.flash_attention else square
        backward = 2.5 * causal if t.flash_attention else 2 * square
        e = self.e
        scores = square / (qk + v) / 2  # elements of the score matrix
        softmax = 0.0 if t.flash_attention else scores * (2 * e + (8 if t.attention_softmax_in_fp32 else 2 * e))
        fwd = Work(attention_flops=forward, memory_bytes=softmax)
        return PassWork(fwd, Work(attention_flops=backward, memory_bytes=2 * softmax), Work(), recompute=fwd)

    def _elementwise(self, kind: str) -> Work:
        """Norms, residual adds, rotary embedding and the activation function of one layer, forward."""
        m, t = self.model, self.training
        e = self.e
        moved = (2 * 2 + 2 * 3) * self.hidden_bytes  # two norms (read, write), two residual adds (2 reads, 1 write)
        if m.position_embedding_type == "rope":
            moved += 2 * self.tokens * (m.num_attention_heads + m.query_groups) / t.tp * m.head_dim * e
        act = 3 if m.swiglu else 2  # SwiGLU reads 2F, writes F; GELU reads F, writes F
        if kind == "dense":
            moved += act * self.tokens * m.ffn / t.tp * e
        else:
            copies = self.residual_tokens * m.moe_router_topk * t.etp
            moved += act * copies * m.expert_ffn / t.etp * e + 4 * copies * m.hidden_size * e  # + (un)permute
            moved += act * self.tokens * (m.moe_shared_expert_intermediate_size or 0) / t.tp * e
        return Work(memory_bytes=moved)

    def layer(self, kind: str) -> PassWork:
        """One layer of ``kind``: GEMMs, attention and element-wise work, with what selective recompute repeats."""
        m, t = self.model, self.training
        attention = self._gemm(self.tokens, attention_params(m, t.tp))
        core = self._attention_core()
        params = layer_params(m, t, kind)
        if kind == "dense":
            mlp = self._gemm(self.tokens, params["mlp"].total)
            mlp_recompute = mlp.forward if t.recomputes("mlp") else Work()
        else:
            copies = self.residual_tokens * m.moe_router_topk * t.etp
            routed = self._gemm(copies, params["experts"].total / (m.num_experts // t.ep))
            shared = self._gemm(self.tokens, params["shared_expert"].total) if "shared_expert" in params else None
            router = self._gemm(self.residual_tokens, params["router"].total)
            mlp = _sum(routed, router, *([shared] if shared else []))
            mlp_recompute = (mlp.forward if t.recomputes("moe") else
                             shared.forward if shared and t.recomputes("shared_experts") else Work())
        element = self._elementwise(kind)
        forward = attention.forward + core.forward + mlp.forward + element
        recompute = (core.recompute if t.recomputes("core_attn") else Work()) + mlp_recompute
        return PassWork(forward, attention.backward_input + core.backward_input + mlp.backward_input + element.scaled(2),
                        attention.backward_weight + mlp.backward_weight, recompute)

    def embedding(self) -> PassWork:
        """Token (and position) lookup: memory-bound; its gradient, a scatter-add, runs in B (split-backward
        runners do not defer it)."""
        moved = self.hidden_bytes
        return PassWork(Work(memory_bytes=moved), Work(memory_bytes=2 * moved), Work())

    def head(self) -> PassWork:
        """Final norm, output layer and the vocab-parallel cross entropy."""
        m, t = self.model, self.training
        vocab = m.padded_vocab(t.tp) / t.tp
        output = self._gemm(self.tokens, vocab * m.hidden_size)
        loss = Work(memory_bytes=self.tokens * vocab * (t.activation_bytes + 3 * 4))  # logits -> fp32 softmax
        norm = Work(memory_bytes=2 * self.hidden_bytes)
        return PassWork(output.forward + loss + norm, output.backward_input + loss + norm.scaled(2),
                        output.backward_weight)

    def part(self, name: str) -> PassWork:
        return self.embedding() if name == "embedding" else self.head() if name == "head" else self.layer(name)

    def model_flops(self) -> float:
        """Model FLOPs of one microbatch on one rank, all three passes, no recompute (MFU's numerator):
        GEMMs, and attention with causal masking counted."""
        def useful(work: PassWork, attention_share: float) -> float:
            return sum(w.gemm_flops for w in work.passes()) + work.forward.attention_flops * attention_share * 3

        causal_share = 1.0 if self.training.flash_attention else 0.5
        layers = Counter(self.model.layer_kinds)
        return sum(n * useful(self.layer(k), causal_share) for k, n in layers.items()) + useful(self.head(), 0)


def _sum(*works: PassWork) -> PassWork:
    return PassWork(*(sum((w.passes()[i] for w in works), Work()) for i in range(3)))


@dataclass(frozen=True)
class PartTimes:
    """Seconds of each pass of one part, and what its selective recompute adds to B."""

    forward: float
    backward_input: float
    backward_weight: float
    recompute: float = 0.0


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
    parts = [p for p in PARTS if p in work.model.layer_kinds or p in ("embedding", "head")]
    times = {}
    for part in parts:
        pw = work.part(part)
        seconds = [w.seconds(hardware, precision) * calibration.factor(part, name) for w, name in zip(pw.passes(), PASSES)]
        recompute = pw.recompute.seconds(hardware, precision) * calibration.factor(part, "forward")
        times[part] = PartTimes(*seconds, recompute)
    return times


def optimizer_seconds(local_params: float, hardware: HardwareSpec) -> float:
    """Adam's step over the parameters a rank updates: memory-bound, reading the fp32 gradient, master
    weight and two moments (16 bytes) and writing the last three and the bf16 weight (14 bytes)."""
    return local_params * 30 / (hardware.hbm_bandwidth_bytes_per_s * hardware.memory_bandwidth_fraction)
