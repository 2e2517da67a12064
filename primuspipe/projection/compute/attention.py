"""The attention block: its projections (plain or MLA's), the attention kernels' FLOPs (causal, windowed, with
flash attention's recomputing backward) and what ring attention moves merging its steps under context
parallelism.

The kernels' FLOPs are timed at the hardware's attention rate, not as GEMMs, since fused kernels reach a rate of
their own; megatron-core's local attention, which runs as GEMMs, is in :mod:`.unfused_attention`.
"""

from __future__ import annotations

import math

from primuspipe.projection.compute.linear import LinearWork
from primuspipe.projection.compute.unfused_attention import UnfusedAttentionWork
from primuspipe.projection.compute.work import NO_WORK, PassWork, Work, sum_passes

ATTENTION_BLOCK = 128
"""Queries and keys per block of a flash attention kernel (FlashAttention-2's and cuDNN's tiles for head
dimensions up to 128): the granularity at which a sliding window's masked work is skipped."""


class AttentionWork(LinearWork, UnfusedAttentionWork):
    """The attention block's projections, kernels and ring merges on one rank for one microbatch."""

    def _attention_projections(self) -> tuple[PassWork, PassWork]:
        """(all projections of the attention block, the MLA up-projections among them)."""
        m, t, tokens, h = self.model, self.training, self.tokens, self.model.hidden_size
        heads = m.num_attention_heads / t.tp
        if not m.multi_latent_attention:
            kv = m.query_groups / t.tp * m.head_dim
            qkv = self._linear(tokens, h, heads * m.head_dim + 2 * kv, norm_fed=True, tensor_parallel="column",
                               split=self._separate_linears(heads * m.head_dim, kv, kv))
            proj = self._linear(tokens, heads * m.head_dim, h, tensor_parallel="row")
            return sum_passes(qkv, proj), NO_WORK
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        # The down-projections are replicated (TE's TELinear, parallel_mode "duplicated", in megatron-core 0.19's
        # MLASelfAttention) and take the layer input as it comes: the rank's 1/TP of the tokens under sequence
        # parallelism; the up-projections gather them.
        down = self.latent_tokens
        if m.q_lora_rank is None:
            query, q_up = self._linear(tokens, h, heads * qk), None
        else:
            q_up = self._linear(tokens, m.q_lora_rank, heads * qk)
            query = sum_passes(self._linear(down, h, m.q_lora_rank), q_up)
        kv_up = self._linear(tokens, m.kv_lora_rank, heads * (m.qk_head_dim + m.v_head_dim))
        kv = sum_passes(self._linear(down, h, m.kv_lora_rank + m.qk_pos_emb_head_dim), kv_up)
        ups = sum_passes(kv_up, *([q_up] if q_up else []))
        return sum_passes(query, kv, self._linear(tokens, heads * m.v_head_dim, h)), ups

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
