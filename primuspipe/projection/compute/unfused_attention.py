"""megatron-core's local attention (``attention_backend: local``, ``--transformer-impl local``): the score and
context products as batched GEMMs, the unfused masked softmax around them, and the element-wise passes the local
spec runs as kernels of their own where Transformer Engine folds them into a GEMM or attention kernel.

Apart from the fused kernels (:mod:`.attention`) because it computes the whole score square and moves it through
memory several times, which no attention-kernel rate describes. Builds on :mod:`.mla` (the heads' widths) and
:mod:`.dropout` (the dropout over the probabilities).
"""

from __future__ import annotations

from dataclasses import replace

from primuspipe.projection.compute.dropout import DropoutWork
from primuspipe.projection.compute.mla import MLAWork
from primuspipe.projection.compute.work import NO_WORK, PassWork, Work
from primuspipe.projection.gemm import Gemm

CUDA_SOFTMAX_BACKWARD_PRODUCT = 3
"""Score-matrix passes of the ``grad * output`` temporary PyTorch's GPU softmax backward makes before its kernel
(``softmax_backward_cuda_out`` in ``SoftMax.cu``; read the gradient and the probabilities, write the product), which
the CPU kernel does without: what an unfused softmax moves on a GPU beyond the aten operations a CPU run dispatches."""


class UnfusedAttentionWork(MLAWork, DropoutWork):
    """The local attention's GEMMs and memory traffic on one rank for one microbatch."""

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
