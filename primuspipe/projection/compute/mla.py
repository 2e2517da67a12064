"""What multi-latent attention (DeepSeek's MLA) changes in a layer: its heads' query/key and value widths, the
tokens its replicated down-projections see, and the element-wise work of its latent norms and rotary assembly.

The head widths live here because MLA is what makes the query/key width differ from the value width; every
attention formula reads them from :attr:`MLAWork.head_dims`.
"""

from __future__ import annotations

from primuspipe.projection.training_spec import RankShape


class MLAWork(RankShape):
    """Attention heads' widths and MLA's latent path on one rank."""

    @property
    def head_dims(self) -> tuple[int, int]:
        """(query/key, value) width of one attention head."""
        m = self.model
        return ((m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim) if m.multi_latent_attention
                else (m.head_dim, m.head_dim))

    @property
    def latent_tokens(self) -> float:
        """Tokens MLA's down-projections and latent norms see on this rank: the sequence-parallel shard."""
        return self.tokens / self.training.tp if self.training.sp else self.tokens

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
