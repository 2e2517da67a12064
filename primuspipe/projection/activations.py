"""Activation bytes one microbatch leaves saved for backward, per layer and per component.

What is counted is what autograd really keeps in megatron-core (checked against saved tensors of real
layers in the tests), per rank, for one microbatch of ``b`` samples: ``T = b * s / CP`` tokens, the
residual stream sharded by TP only under sequence parallelism (``T_r = T / TP`` with SP, else ``T``),
element size ``e`` (2 bytes in bf16/fp16). Following Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), per layer:

* each norm keeps its input ``T_r H e`` and per-token statistics (fp32);
* attention keeps the QKV projection input ``T_r H e``; flash/fused attention keeps Q, K, V as
  projected (``T (a + 2g) d e / TP``), its output ``T a d e / TP`` (also the output projection's input)
  and fp32 log-sum-exp rows; the unfused (local) attention keeps Q and the head-expanded K, V
  (``3 T a d e / TP``), the softmax probabilities ``b (a/TP) (s/CP) s`` in fp32 plus the low-precision
  copy the value GEMM reads, and the output projection's input;
* the MLP keeps its input ``T_r H e``, the activation function's saved tensors and the down
  projection's input: fused SwiGLU keeps only its input (``2F``), unfused SwiGLU four ``F``-wide
  tensors, GELU one; then ``F`` for the down projection, all ``T e / TP``;
* an MoE layer routes ``T_r * k`` token copies (times ETP, whose ranks all see their group's tokens):
  each keeps its hidden state (``H``) and an expert MLP's tensors (width ``F_e / ETP``; the routing
  probability scales the activation, which keeps one more ``F_e`` tensor when unfused); the shared
  expert is an MLP over all tokens; the router keeps top-k indices and probabilities, the routing map
  and the permutation indices (a few bytes per token and expert);
* unfused rotary embedding keeps its cos/sin tables (``4 (s/CP) d e``);
* dropout (when > 0) keeps a one-byte mask per element;
* under torchtitan's DTensor TP (``model_implementation: torchtitan``) the inputs of QKV and of the MLP's first
  linear are kept as gathered, ``T H e`` each instead of ``T_r H e`` (:attr:`ActivationModel.column_input_bytes`).

The MoE-MLP component (routed experts plus the shared expert, whose input is the MoE block's input) is
``T (k + 1) (H + 3 F_e) e`` with fused SwiGLU and a shared expert as wide as one routed expert: the
Primus projection's formula.

Recompute (Megatron's): ``full`` keeps only the input of each checkpointed group of layers (uniform:
groups of ``recompute_num_layers``; block: the first ``recompute_num_layers`` layers of each chunk, one
by one); ``selective`` drops what the named modules would keep and keeps their inputs instead
(``core_attn``: attention keeps the rotated query and key and the fused QKV output V is sliced from; ``mlp`` / ``moe``:
only the block input; ``shared_experts``: only the shared expert's input; ``layernorm``: the norms' outputs,
the inputs of the projections after them, are not kept; ``moe_act``: the experts' activation output, the
down projection's input, is not kept; ``mla_up_proj``: MLA's up-projected queries, keys and values are
not kept, only the latents). These three run only with Transformer Engine in megatron-core and are not
checked against a real layer here.

Op recompute (torchtitan's op-level selective activation checkpointing, ``recompute_granularity: op``) keeps, per
layer, the block's input (the checkpoint's argument) and the outputs its policy saves
(:data:`TORCHTITAN_BLOCK_GEMMS`): every other GEMM's, the flash kernel's output and log-sum-exp rows, and each
reduce-scatter's under sequence parallelism; all else is rebuilt for the block's backward
(:meth:`ActivationModel.op_kept`). The kept outputs are the GEMMs' (bf16) under FP8 too.

FP8 (Transformer Engine): a linear layer whose input exists only for it keeps the FP8 copy it computed
with (1 byte an element) instead -- the normed inputs of the QKV and MLP projections and the experts'
down-projection inputs; the attention output, which the attention kernel keeps anyway, gains an FP8 copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from primuspipe.projection.model_spec import LayerKind
from primuspipe.projection.training_spec import RankShape

_INDEX, _FP32 = 8, 4
"""Bytes of an int64 index, an fp32 value."""
MASK_BYTES = 1
"""Bytes of a boolean mask element (PyTorch's ``native_dropout`` keep mask, the router's routing map); the time
model (:mod:`~primuspipe.projection.compute`) moves the same masks."""


TORCHTITAN_BLOCK_GEMMS = (("wq", "hidden", "query"), ("wk", "hidden", "kv"), ("wv", "hidden", "kv"),
                          ("wo", "query", "hidden"), ("w1", "hidden", "ffn"), ("w3", "hidden", "ffn"),
                          ("w2", "ffn", "hidden"))
"""The ``aten.mm`` calls of torchtitan's Llama ``TransformerBlock`` forward, in the order it makes them, as (name,
input width, output width): ``Attention.forward`` runs ``self.wq(x), self.wk(x), self.wv(x)``, the attention, then
``self.wo``; ``FeedForward.forward`` ``self.w2(F.silu(self.w1(x)) * self.w3(x))`` -- w1 before w3
(``torchtitan/models/llama/model.py`` at 9dec370, ``models/llama3/model.py`` at 820504e and e7c0cae). torchtitan's
op policy (``_custom_policy`` in ``parallelize_llama.py`` at the same commits) counts the block's mms afresh for each
forward and recompute and saves an mm's output unless its count is even ("Saves output of all compute ops, except
every second mm"): wq, wv, w1 and w2 are kept, wk, wo and w3 recomputed. The widths are per rank: ``hidden`` H,
``query`` the heads' ``a d / TP``, ``kv`` the groups' ``g d / TP``, ``ffn`` ``F / TP``; w3 exists with SwiGLU only."""


def op_gemms(swiglu: bool) -> list[tuple[str, str, str, bool]]:
    """The block's GEMMs (:data:`TORCHTITAN_BLOCK_GEMMS`) with whether torchtitan's op policy saves each output."""
    gemms = [g for g in TORCHTITAN_BLOCK_GEMMS if swiglu or g[0] != "w3"]
    return [(*g, count % 2 == 1) for count, g in enumerate(gemms, 1)]


def gemm_width(shape: RankShape, role: str) -> float:
    """Elements per token of one side of a block GEMM on this rank (see :data:`TORCHTITAN_BLOCK_GEMMS`)."""
    m, tp = shape.model, shape.training.tp
    return {"hidden": m.hidden_size, "query": m.num_attention_heads / tp * m.head_dim,
            "kv": m.query_groups / tp * m.head_dim, "ffn": m.ffn / tp}[role]


@dataclass(frozen=True)
class LayerActivations:
    """One layer's saved bytes for one microbatch on one rank."""

    components: dict[str, float]
    """Bytes per component (norms, attention, MLP or router + MoE MLP, dropout masks)."""
    gemm_inputs: float
    """Of those, the inputs of weight GEMMs: what a deferred weight-gradient pass (W) still reads."""
    gemm_output_grads: float
    """Gradients of the weight GEMMs' outputs, created by the input-gradient pass (B) and kept for W."""
    kept_before_core: float = 0.0
    """Of those inputs and gradients, what a split B has kept by its core attention's backward and a fused
    backward has freed by then: the inputs of the MLP's (or MoE block's) GEMMs and of the attention's output
    projection, and the MLP's output gradients. (The output projection's own output gradient is the residual
    stream's gradient, which the backward holds at that moment anyway -- unless sequence parallelism
    all-gathered it.)"""

    @property
    def total(self) -> float:
        return sum(self.components.values())


@dataclass(frozen=True)
class ActivationModel(RankShape):
    """The activation formulas for one (model, training) pair; sizes per rank and microbatch."""

    def _norm(self, tokens: float, width: int) -> float:
        stats = 1 if self.model.normalization == "RMSNorm" else 2
        return tokens * (width * self.e + stats * _FP32)

    def _mlp_activation(self, width: float, *, probs_scaled: bool) -> float:
        """Elements per token the activation function keeps (and the down projection's input)."""
        if self.model.swiglu:
            kept = 2 * width if self.training.bias_activation_fusion else 4 * width
        else:
            kept = width
        scaled = width if probs_scaled and not (self.model.swiglu and self.training.bias_activation_fusion) else 0
        return kept + scaled + width

    @property
    def column_input_bytes(self) -> float:
        """The saved input of QKV and of a dense MLP's first linear: the residual stream's shard, or under torchtitan's
        DTensor TP the gathered tensor autograd kept (``TrainingSpec.keeps_gathered_inputs``), TP times as large."""
        return self.hidden_bytes * (self.training.tp if self.training.keeps_gathered_inputs else 1)

    # -- attention ------------------------------------------------------------------------------------
    @property
    def context_bytes(self) -> float:
        """The core attention's output, the output projection's input."""
        m = self.model
        return self.tokens * m.num_attention_heads / self.training.tp * (m.v_head_dim if m.multi_latent_attention
                                                                         else m.head_dim) * self.e

    def _attention(self) -> tuple[float, float, float]:
        """(kept bytes, GEMM inputs, GEMM output grads) of the attention block."""
        m, t, tp = self.model, self.training, self.training.tp
        e, tokens, heads = self.e, self.tokens, m.num_attention_heads / tp
        if m.multi_latent_attention:
            qk_dim, v_dim = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
            kv_heads = heads
            latents = tokens * (m.kv_lora_rank + (m.q_lora_rank or 0)) * e  # the low-rank projections' outputs
            mixed = tokens * heads * (qk_dim + v_dim) * e  # the key/value up-projection's output
        else:
            qk_dim = v_dim = m.head_dim
            kv_heads = m.query_groups / tp
            latents = 0.0
            mixed = tokens * (heads + 2 * kv_heads) * qk_dim * e  # the fused QKV projection's output
        qkv_in = self.column_input_bytes
        context = self.context_bytes
        scores = t.micro_batch_size * heads * (m.seq_length / t.cp) * m.seq_length
        per_head_norms = m.qk_layernorm and not m.multi_latent_attention
        rope = m.rotary and not m.multi_latent_attention
        # With grouped queries the query is reshaped out of the fused QKV output into a copy; K and V are
        # views of that output, so a saved K or V slice keeps all of it alive.
        query_copy = tokens * heads * qk_dim * e if heads > kv_heads else 0.0
        keeps_mixed = per_head_norms or t.recomputes("core_attn")
        core = 0.0
        if per_head_norms:  # their inputs: the query (copy) and the key slice; their fp32 statistics
            stats = 1 if m.normalization == "RMSNorm" else 2
            core += query_copy + tokens * (heads + kv_heads) * stats * _FP32
        # cos and sin, once for queries and once for keys; torchtitan multiplies by a view of the model's one
        # freqs_cis buffer (its rotary is never fused: RankShape.rope_fused), which no layer adds
        if rope and not self.rope_fused and t.model_implementation != "torchtitan":
            core += 4 * (m.seq_length / t.cp) * qk_dim * e
        if t.recomputes("core_attn"):  # the checkpoint keeps its inputs: query, key, and V's slice
            new_qk = rope or per_head_norms  # rotated or normalised query and key are new tensors
            core += tokens * (heads + kv_heads) * qk_dim * e if new_qk else query_copy
        elif t.flash_attention:
            if not (m.multi_latent_attention and t.recomputes("mla_up_proj")):
                core += tokens * (heads * qk_dim + kv_heads * (qk_dim + v_dim)) * e
            core += scores / m.seq_length * _FP32
        else:
            probs = scores * (_FP32 if t.attention_softmax_in_fp32 else e)
            if m.attention_dropout > 0:
                probs += scores * (MASK_BYTES + e)
            elif t.attention_softmax_in_fp32 and e < _FP32:  # the low-precision copy the value GEMM reads
                probs += scores * e
            core += tokens * heads * (2 * qk_dim + v_dim) * e + probs
        if keeps_mixed:
            core += mixed
        fp8_copy = 0.5 if t.fp8 else 1.0  # bytes of a kept GEMM input, relative to the activation dtype
        kept_in = 0.0 if t.recomputes("layernorm") else qkv_in * fp8_copy
        kept = kept_in + latents + core + context * (1.5 if t.fp8 else 1.0)
        gemm_inputs = qkv_in + latents + context
        # the output projection's output gradient is all T tokens' even under sequence parallelism, which
        # all-gathers it for the projection's backward (the reduce-scatter's backward)
        grads = tokens * ((heads + 2 * kv_heads) * qk_dim) * e + tokens * m.hidden_size * e
        return kept, gemm_inputs, grads

    # -- MLP / MoE ------------------------------------------------------------------------------------
    def _dense_mlp(self, width: int, tokens: float, *, recompute: bool) -> tuple[float, float, float]:
        """(kept, GEMM inputs, GEMM output grads) of an MLP of ``width`` over ``tokens`` whose input
        (``T_r H``) is counted by the caller."""
        if recompute:
            return 0.0, 0.0, 0.0
        shard = width / self.training.tp
        act = tokens * self._mlp_activation(shard, probs_scaled=False) * self.e
        if self.training.fp8:  # the down projection keeps its input as FP8
            act -= 0.5 * tokens * shard * self.e
        up = shard * (2 if self.model.swiglu else 1)
        return act, tokens * shard * self.e, tokens * (up + self.model.hidden_size) * self.e

    @property
    def permuted_rows_per_copy(self) -> float:
        """Rows of the experts' tensors per routed token copy. Primus's sync-free stage 3 sizes the permuted
        tokens for the worst case so no count reaches the host: ``permute_max_token_num`` = the microbatch's
        tokens x TP x EP x top-k (``PrimusTurboDeepEPTokenDispatcher``), every expert tensor that many rows
        whatever the routing -- TP x EP / ETP times the copies (AMD: "significantly more GPU memory")."""
        t = self.training
        return t.tp * t.ep / t.etp if t.turbo_sync_free_moe_stage >= 3 else 1.0

    def _moe(self) -> tuple[dict[str, float], float, float]:
        m, t = self.model, self.training
        block_input = 0.0 if t.recomputes("layernorm") else self.hidden_bytes
        if t.recomputes("moe"):
            return {"moe_mlp": self.hidden_bytes}, self.hidden_bytes, 0.0
        copies = self.residual_tokens * m.moe_router_topk * t.etp * self.permuted_rows_per_copy
        width = m.expert_ffn / t.etp
        routed_act = copies * self._mlp_activation(width, probs_scaled=True) * self.e
        if t.recomputes("moe_act"):  # the activation's output (the down projection's input) is rebuilt
            routed_act -= copies * width * self.e
        elif t.experts_fp8:  # (the legacy GroupedMLP's BF16 experts keep BF16 inputs under FP8)
            routed_act -= 0.5 * copies * width * self.e
        if (m.activation_func_clamp_value is not None and not t.recomputes("moe_act")
                and t.expert_kernels != "automodel-deepep"):  # AutoModel's compiled GLU keeps fc1's output only
            # the clamped copy of fc1's output the activation saves, beside fc1's output the clamps save
            # (megatron-core's weighted_bias_quick_geglu_impl / glu; compute.WorkModel._expert_clamp)
            routed_act += copies * 2 * width * self.e
        routed = copies * m.hidden_size * self.e * (0.5 if t.experts_fp8 else 1.0) + routed_act
        routed_grads = copies * (width * (2 if m.swiglu else 1) + m.hidden_size) * self.e
        routed_inputs = copies * (m.hidden_size + width) * self.e
        router = self.residual_tokens * (m.moe_router_topk * (2 * _INDEX + _FP32 + self.e) + m.num_experts * (MASK_BYTES + self.e))
        if m.moe_shared_expert_intermediate_size:
            shared, shared_in, shared_grads = self._dense_mlp(m.moe_shared_expert_intermediate_size, self.tokens,
                                                              recompute=t.recomputes("shared_experts"))
            moe_mlp = routed + block_input + shared
            shared_in += block_input  # the shared expert's up projection reads the block input
        else:
            shared = shared_in = shared_grads = 0.0
            moe_mlp = routed
            router += block_input  # read by the router alone, whose weight gradient stays in B
        return ({"router": router, "moe_mlp": moe_mlp}, routed_inputs + shared_in, routed_grads + shared_grads)

    # -- a whole layer --------------------------------------------------------------------------------
    def layer(self, kind: LayerKind) -> LayerActivations:
        """Saved bytes of one layer of ``kind`` (without full recompute: see :meth:`stage`)."""
        m, t = self.model, self.training
        attention, attn_in, attn_grads = self._attention()
        parts = {"input_norm": self._norm(self.residual_tokens, m.hidden_size), "attention": attention,
                 "pre_mlp_norm": self._norm(self.residual_tokens, m.hidden_size)}
        if kind == "dense":
            mlp_in = self.column_input_bytes
            act, act_in, act_grads = self._dense_mlp(m.ffn, self.tokens, recompute=t.recomputes("mlp"))
            kept_in = 0.0 if t.recomputes("layernorm") else mlp_in * (0.5 if t.fp8 and not t.recomputes("mlp") else 1.0)
            parts["mlp"] = kept_in + act
            inputs, grads = attn_in + mlp_in + act_in, attn_grads + act_grads
        else:
            moe, moe_in, moe_grads = self._moe()
            parts.update(moe)
            inputs, grads = attn_in + moe_in, attn_grads + moe_grads
        if m.hidden_dropout > 0:
            parts["dropout"] = 2 * self.residual_tokens * m.hidden_size * MASK_BYTES
        # the output projection's output gradient is the residual stream's, which B holds then anyway, unless
        # sequence parallelism all-gathered it into a tensor of its own
        proj_grad = self.tokens * m.hidden_size * self.e if t.sequence_parallel else 0.0
        before_core = self.context_bytes + proj_grad + (inputs - attn_in) + (grads - attn_grads)
        return LayerActivations(parts, inputs, grads, before_core)

    def op_kept(self, kind: LayerKind) -> LayerActivations:
        """One layer under torchtitan's op recompute: ``layer(kind)`` with only what the checkpoint keeps as its
        components (W's inputs and gradients, which the backward rebuilds, as they are).

        * ``input_norm``: the block's input ``T_r H``, the checkpoint's argument (the first norm reads it);
        * ``attention``: wq's and wv's outputs, ``_scaled_dot_product_flash_attention``'s output ``T a d / TP`` and
          its fp32 log-sum-exp ``T a / TP``, and under sequence parallelism with TP > 1 wo's reduce-scatter ``T_r H``
          (``RowwiseParallel`` to ``Shard(1)``: ``reduce_scatter_tensor``, in the save list; without sequence
          parallelism TP all-reduces, which it is not);
        * ``mlp``: w1's output ``T F / TP`` and, eagerly, w2's output ``T H`` (its partial sums before the
          reduction: all ``T`` tokens) and its reduce-scatter ``T_r H`` under sequence parallelism; compiled
          (:attr:`~primuspipe.projection.training_spec.TrainingSpec.op_recompute_compiled`), not those two: only the
          residual add reads them, whose backward needs no tensor.

        Eager checkpointing (``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts``) caches every
        saved op's output from the forward until the block's recompute, whether its backward reads it or not."""
        t, e, tokens = self.training, self.e, self.tokens
        full = self.layer(kind)
        scattered = self.hidden_bytes if t.sp and t.tp > 1 else 0.0
        saved = {name: tokens * gemm_width(self, out) * e
                 for name, _, out, keep in op_gemms(self.model.swiglu) if keep}
        if t.op_recompute_compiled:
            saved.pop("w2", None)
        heads = self.model.num_attention_heads / t.tp
        attention = saved.get("wq", 0.0) + saved.get("wv", 0.0) + self.context_bytes + tokens * heads * _FP32 + scattered
        mlp = saved.get("w1", 0.0) + (saved["w2"] + scattered if "w2" in saved else 0.0)
        parts = {"input_norm": self.hidden_bytes, "attention": attention, "pre_mlp_norm": 0.0, "mlp": mlp}
        return LayerActivations(parts, full.gemm_inputs, full.gemm_output_grads, full.kept_before_core)

    @cached_property
    def _layers(self) -> dict[LayerKind, LayerActivations]:
        kept = self.op_kept if self.training.recompute_granularity == "op" else self.layer
        return {kind: kept(kind) for kind in set(self.model.layer_kinds)}

    def checkpoint(self) -> float:
        """What a fully recomputed group of layers keeps: its input."""
        return self.hidden_bytes

    def recomputed(self, chunk_layers: range) -> list[bool]:
        """Which layers of one model chunk a full recompute re-runs in backward."""
        t = self.training
        if t.recompute_granularity != "full":
            return [False] * len(chunk_layers)
        if t.recompute_method == "block":
            return [j < t.recompute_num_layers for j in range(len(chunk_layers))]
        return [True] * len(chunk_layers)

    def layer_bytes(self, chunk_layers: range) -> list[float]:
        """Saved bytes of each layer of one model chunk, full recompute applied (uniform keeps one input
        per group of recompute_num_layers layers, block one per recomputed layer)."""
        t = self.training
        uniform = t.recompute_method == "uniform"
        return [(self.checkpoint() if not uniform or j % t.recompute_num_layers == 0 else 0.0) if again
                else self._layers[self.model.layer_kinds[i]].total
                for j, (i, again) in enumerate(zip(chunk_layers, self.recomputed(chunk_layers)))]

    def recompute_working_set(self, chunk_layers: range) -> float:
        """Bytes a full-recompute backward rebuilds at once (one group's activations), held only while
        that group's backward runs; under op recompute what one block's recompute rebuilds beyond what it kept."""
        t = self.training
        if t.recompute_granularity == "op":
            kinds = {self.model.layer_kinds[i] for i in chunk_layers}
            return max((max(self.layer(k).total - self._layers[k].total, 0.0) for k in kinds), default=0.0)
        if t.recompute_granularity != "full":
            return 0.0
        group = 1 if t.recompute_method == "block" else t.recompute_num_layers
        return group * max((self._layers[self.model.layer_kinds[i]].total for i in chunk_layers), default=0.0)

    def wgrad_bytes(self, chunk_layers: range) -> float:
        """Bytes a deferred W needs after B: GEMM inputs and output gradients of every layer."""
        return sum(self._layers[k].gemm_inputs + self._layers[k].gemm_output_grads
                   for k in (self.model.layer_kinds[i] for i in chunk_layers))

    def b_rise(self, chunk_layers: range, *, head: bool, freed_in_layers: float = 0.0) -> float:
        """Bytes by which a split-backward B of one chunk peaks above a fused backward's peak as the projection
        counts it (what the rank held when the backward started, plus the local attention's working set, less
        ``freed_in_layers``: what that working set's moment inside a layer no longer holds, the microbatch's head,
        :mod:`~primuspipe.projection.stage_costs`).

        B walks down the chunk (the head first when the chunk has it). Each part it has passed freed what its
        backward used but kept its GEMMs' inputs and output gradients for W (:meth:`wgrad_bytes`), so the level
        drifts by ``W bytes - held bytes`` a part. Inside a layer, at its core attention's backward, the layer's
        :attr:`LayerActivations.kept_before_core` is still there where a fused backward has freed it (the local
        attention's working set already counts the fused backward's freeing, :meth:`attention_working_set`; other
        backends count it here). The rise is the largest of those moments and of B's end (more kept than held:
        full recompute, or sequence parallelism, under which W keeps the row-parallel projections' all-gathered
        output gradients), never below 0.

        Recorded on CPU for real megatron-core local-spec layers and models run through primuspipe's split
        backward (``tests/projection/test_split_backward_memory.py``: dense GELU and SwiGLU, grouped queries, MoE
        with and without a shared expert, TP 2 with and without sequence parallelism, exact). On the lent H100
        the local-spec model of ``bench/bench_local_spec.py`` (pp 1) peaked 0.404 GB (12.04 ``sbh``) higher under
        ZB-H1 than under 1F1B: the top layer's MLP and output-projection inputs and MLP output gradients (11
        ``sbh``), the output layer's input (1 ``sbh``) and its logits gradient; at two more shapes
        (``bench/results/gpu_local_shapes_h100.json``, vocabularies of 32,000 and 50,304) 0.726 and 0.415 GB, mostly
        the logits gradient W keeps. The projection gives 0.400, 0.726 and 0.415 GB."""
        freed_by_fused = 0.0 if self._local_scores() else 1.0  # the local working set subtracts it itself
        drift = self.head_gemm_bytes() - self.head() if head else 0.0
        rise = drift
        kinds = [self.model.layer_kinds[i] for i in chunk_layers]
        for kind, held in reversed(list(zip(kinds, self.layer_bytes(chunk_layers)))):
            layer = self._layers[kind]
            inside = drift + layer.kept_before_core - freed_by_fused * self._after_core(kind)
            rise = max(rise, inside + freed_in_layers)
            drift += layer.gemm_inputs + layer.gemm_output_grads - held
        return max(rise, drift, 0.0)

    def mtp(self) -> float:
        """One multi-token-prediction module: its layer, the projection's 2H input, and its head."""
        m = self.model
        return self._layers[m.layer_kinds[-1]].total + 2 * self.hidden_bytes + self.head()

    # -- first and last stage -------------------------------------------------------------------------
    def embedding(self) -> float:
        """The first stage's extra: token (and position) indices, and the embedding dropout mask."""
        m = self.model
        indices = self.tokens * _INDEX * (2 if m.position_embedding_type == "learned_absolute" else 1)
        return indices + (self.residual_tokens * m.hidden_size * MASK_BYTES if m.hidden_dropout > 0 else 0)

    def head(self) -> float:
        """The last stage's extra: final norm, output-layer input, fp32 softmax of the vocab-parallel
        cross entropy (``T V / TP`` floats) and the labels."""
        return self.head_tensors() + self.tokens * 2 * _INDEX

    def head_tensors(self) -> float:
        """What of :meth:`head` the output layer and loss make and their backward frees: all but the labels (the
        batch the step function holds), so a layer's moments (forward before, backward after) do not hold it."""
        m, tp = self.model, self.training.tp
        logits = self.tokens * m.padded_vocab(tp) / tp * self._saved_loss_bytes
        return self._norm(self.residual_tokens, m.hidden_size) + self.hidden_bytes + logits

    @property
    def _saved_loss_bytes(self) -> float:
        """Bytes a logit the loss keeps for its backward: Transformer Engine's fused loss (``te``) its gradient in
        the logits' dtype, megatron-core's unfused and ``native`` fused ones their fp32 softmax, PyTorch's
        ``F.cross_entropy`` its log-softmax output in the dtype it runs in."""
        t = self.training
        if t.torch_cross_entropy is not None:
            return _FP32 if t.torch_cross_entropy == "fp32" else self.e
        return self.e if self._te_loss else _FP32

    @property
    def _te_loss(self) -> bool:
        t = self.training
        return t.cross_entropy_loss_fusion and t.cross_entropy_fusion_impl == "te"

    def loss_working_set(self) -> float:
        """Bytes the unfused loss holds for a moment beyond :meth:`head` (what it keeps for the backward):
        megatron-core's ``vocab_parallel_cross_entropy`` makes its fp32 copy of the logits (``.float()`` in
        ``calculate_logits_max``) while ``GPTModel._postprocess`` still holds the output layer's logits, and
        its backward casts the fp32 gradient back to the activation dtype while that copy is alive: ``T V /
        TP`` elements at activation bytes, both times; its ``native`` fused form alike (``calculate_logits_max``
        returns the fp32 copy, ``calculate_gradients`` writes the bf16 gradient beside the softmax). Nothing
        with Transformer Engine's fused loss, or in fp32 training (``.float()`` returns the tensor itself).
        PyTorch's ``F.cross_entropy`` (``torch_cross_entropy``): two logit-sized gradients in its dtype during
        the backward."""
        m, t = self.model, self.training
        logits = self.tokens * m.padded_vocab(t.tp) / t.tp
        if t.torch_cross_entropy is not None:
            # backward: nll_loss's zero-filled gradient and log-softmax's input gradient beside the saved output
            # (forward, the upcast's logits and fp32 copy beside that output are no more)
            return logits * 2 * self._saved_loss_bytes
        if self._te_loss or self.e >= _FP32:
            return 0.0
        return logits * self.e

    def _local_scores(self) -> float:
        """Elements of one layer's attention score matrix on this rank where megatron-core's local
        ``DotProductAttention`` computes it whole (``attention_backend`` local); 0 otherwise."""
        m, t = self.model, self.training
        if t.attention_backend != "local":
            return 0.0
        return t.micro_batch_size * m.num_attention_heads / t.tp * (m.seq_length / t.cp) * m.seq_length

    def attention_working_set(self) -> float:
        """Bytes the local attention holds for a moment beyond what the stage keeps (nothing for other backends), at
        the larger of two moments of one layer:

        * forward, once the softmax has run: the low-precision scores ``baddbmm`` wrote (``DotProductAttention
          .forward`` holds them in ``attention_scores`` until it returns) and, with the softmax in fp32, the fp32
          copy ``forward_torch_softmax`` masked in place: ``e + 4`` bytes a score (``e`` without the fp32 softmax);
        * backward, in the softmax's backward: PyTorch's CUDA kernel (``softmax_backward_cuda_out``,
          ``aten/src/ATen/native/cuda/SoftMax.cu``) first makes ``grad * output``, a score-sized temporary in the
          gradient's dtype, beside the incoming gradient and its result; with the softmax in fp32 that is three
          fp32 tensors, the low-precision probabilities the value GEMM kept already freed: ``12 - e``; without
          it three low-precision ones, ``3e``, as much as the masked scores' gradient autograd's ``CopySlices``
          rebuilds next (a zeroed base, its strided copy and a clone beside the softmax's and the mask's
          gradients, less the freed probabilities); and two gradients in flight, the residual stream's and the
          value's (waiting for the QKV split's concatenation). The CPU kernel makes no temporary (``8 - e`` with
          the softmax in fp32): the lent H100's allocator trace of the local-spec run shows the three fp32
          tensors at its peak (``bench/gpu_memory_peak.py``).

        What the layer keeps after its core attention (the output projection's input, the pre-MLP norm, the MLP) is
        not yet made at the first moment and already freed at the second, so it comes off both. Held against the
        live bytes of a local-spec layer's forward and backward (``tests/projection/test_local_spec.py``)."""
        m, t, e = self.model, self.training, self.e
        scores = self._local_scores()
        if not scores:
            return 0.0
        fp32 = t.attention_softmax_in_fp32 and e < _FP32
        forward = scores * (e + _FP32 if fp32 else e)
        grads = self.hidden_bytes + self.tokens * m.query_groups / t.tp * m.head_dim * e
        backward = scores * (3 * _FP32 - e if fp32 else 3 * e) + grads
        return max(forward, backward) - min(self._after_core(k) for k in self._layers)

    def _after_core(self, kind: LayerKind) -> float:
        """What a layer of ``kind`` keeps after its core attention (the output projection's input, the pre-MLP
        norm, the MLP): not yet made when the core attention runs forward, freed by a fused backward by the time
        it runs backward."""
        layer = self._layers[kind]
        return layer.total - layer.components["input_norm"] - layer.components["attention"] + self.context_bytes

    def attention_buffer(self) -> float:
        """The buffer the local attention's ``baddbmm`` is given as its ``input`` (``beta=0``):
        ``parallel_state.get_global_memory_buffer().get_tensor(..., "mpu")``, allocated at the first forward and
        kept for the run, one per rank (every layer asks for the same shape and name)."""
        return self._local_scores() * self.e

    def head_gemm_bytes(self) -> float:
        """Output layer input and its output gradient (what a deferred W of the last stage reads)."""
        m, tp = self.model, self.training.tp
        return self.hidden_bytes + self.tokens * m.padded_vocab(tp) / tp * self.e
