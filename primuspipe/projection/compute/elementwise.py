"""A layer's memory-bound kernels: norms, residual adds, rotary embedding, the activation function, MoE
permutation and the router's softmax, each priced by the bytes it reads and writes, its backward by
:data:`BACKWARD_BYTES_PER_FORWARD_BYTE`.

Counted kernel by kernel, not as one factor on the forward, because megatron-core's fused kernels and
torchtitan's eager chains move very different bytes for the same function. Builds on :mod:`.moe` (the token copies
the permutation moves) and :mod:`.mla` (MLA's latent norms and rotary, counted with the others).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from primuspipe.projection.compute.mla import MLAWork
from primuspipe.projection.compute.moe import MoEWork
from primuspipe.projection.compute.work import NO_WORK, PassWork, Work

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


def elementwise_pass(forward_bytes: Mapping[str, float]) -> PassWork:
    """Element-wise kernels' forward and input-gradient traffic from their forward bytes by kernel."""
    forward = sum(forward_bytes.values())
    backward = sum(b * BACKWARD_BYTES_PER_FORWARD_BYTE[k] for k, b in forward_bytes.items())
    return PassWork(Work(memory_bytes=forward), Work(memory_bytes=backward), Work())


class ElementwiseWork(MoEWork, MLAWork):
    """One layer's element-wise kernels on one rank for one microbatch."""

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
        return elementwise_pass(self._elementwise_kernels(kind))
