"""Parameter counts, per component and per pipeline rank, as megatron-core allocates them.

Tensor parallelism shards the attention and MLP matrices and the vocabulary; norms, the MoE router and
position embeddings are replicated on every TP rank. Expert parallelism spreads the routed experts
(``num_experts / EP`` per rank), expert tensor parallelism shards each expert. Counts are split into
*dense* parameters (their optimizer state is sharded over the DP * CP ranks) and *expert* parameters
(sharded over the expert-data-parallel ranks), because the distributed optimizer treats them apart.

Formulas (H hidden, a heads, g key/value groups, d head dim, F MLP width, V padded vocabulary; each
weight matrix is in x out, biases only with ``add_bias_linear``):

* norm: H (RMSNorm) or 2H (LayerNorm, with bias);
* attention: ``H * (a + 2g) * d`` (QKV) + ``a * d * H`` (output), both / TP; per-head q/k norms with
  ``qk_layernorm``; multi-latent attention: ``H * a (d_qk + d_rope)`` for queries (or a down/up pair
  through ``q_lora_rank``; with ``qk_layernorm`` a norm of the query latent, or, without a query
  latent, of the layer input, fused into the projection as Megatron does), ``H * (kv_lora_rank + d_rope)`` down and ``kv_lora_rank * a (d_qk + d_v)``
  up for keys/values, ``a * d_v * H`` output (the down projections are replicated, as Transformer
  Engine builds them);
* MLP: ``H * F * (2 if SwiGLU else 1) + F * H``, / TP;
* MoE layer: router ``E * H``, ``E / EP`` experts of ``(H * F_e * (2|1) + F_e * H) / ETP`` each, and the
  shared expert as an MLP of width ``moe_shared_expert_intermediate_size``;
* embedding ``V * H / TP`` (+ ``max_position_embeddings * H`` for learned positions) on stage 0; final
  norm and output layer ``V * H / TP`` on the last stage, which keeps a copy of the embedding even when
  the weights are tied (Megatron all-reduces the two copies' gradients) unless it is the first stage too: a
  single model chunk (pipeline of one stage) builds its output layer on the embedding's own weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from primuspipe.projection.layout import StageLayout
from primuspipe.projection.model_spec import LayerKind, ModelSpec
from primuspipe.projection.training_spec import TrainingSpec


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a component on one rank, split by how the optimizer shards them."""

    dense: int = 0
    expert: int = 0

    def __add__(self, other: ParamCount) -> ParamCount:
        return ParamCount(self.dense + other.dense, self.expert + other.expert)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _norm(model: ModelSpec, width: int) -> int:
    return width if model.normalization == "RMSNorm" else 2 * width


def _linear(model: ModelSpec, fan_in: int, fan_out: int, shards: int, *, bias_shards: int | None = None,
            bias: bool | None = None) -> int:
    """A weight of ``fan_in x fan_out`` split ``shards`` ways, and its bias (split ``bias_shards`` ways:
    a row-parallel layer's bias is whole on every rank)."""
    has_bias = model.add_bias_linear if bias is None else bias
    return fan_in * fan_out // shards + (fan_out // (bias_shards or shards) if has_bias else 0)


def _mlp(model: ModelSpec, width: int, tp: int) -> int:
    up = _linear(model, model.hidden_size, width * (2 if model.swiglu else 1), tp)
    return up + _linear(model, width, model.hidden_size, tp, bias_shards=1)


def attention_params(model: ModelSpec, tp: int) -> int:
    """One attention block on one TP rank (its input norm excluded)."""
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_dim
    if model.multi_latent_attention:
        q_width = a * (model.qk_head_dim + model.qk_pos_emb_head_dim)
        if model.q_lora_rank is None:  # with qk_layernorm Megatron fuses a norm of the input into the projection
            query = _linear(model, h, q_width, tp, bias=False) + (_norm(model, h) if model.qk_layernorm else 0)
        else:
            query = (_linear(model, h, model.q_lora_rank, 1, bias=False) + _linear(model, model.q_lora_rank, q_width, tp, bias=False)
                     + (_norm(model, model.q_lora_rank) if model.qk_layernorm else 0))
        kv = (_linear(model, h, model.kv_lora_rank + model.qk_pos_emb_head_dim, 1, bias=False)
              + _linear(model, model.kv_lora_rank, a * (model.qk_head_dim + model.v_head_dim), tp, bias=False)
              + (_norm(model, model.kv_lora_rank) if model.qk_layernorm else 0))
        return query + kv + _linear(model, a * model.v_head_dim, h, tp, bias_shards=1)
    qkv = _linear(model, h, (a + 2 * model.query_groups) * d, tp, bias=model.add_bias_linear or model.add_qkv_bias)
    qk_norms = 2 * _norm(model, d) if model.qk_layernorm else 0
    return qkv + qk_norms + _linear(model, a * d, h, tp, bias_shards=1)


def layer_params(model: ModelSpec, training: TrainingSpec, kind: LayerKind) -> dict[str, ParamCount]:
    """Per component, one layer of ``kind`` on one (TP, EP) rank."""
    tp = training.tp
    parts = {
        "input_norm": ParamCount(_norm(model, model.hidden_size)),
        "attention": ParamCount(attention_params(model, tp)),
        "pre_mlp_norm": ParamCount(_norm(model, model.hidden_size)),
    }
    if kind == "dense":
        parts["mlp"] = ParamCount(_mlp(model, model.ffn, tp))
        return parts
    parts["router"] = ParamCount(model.num_experts * model.hidden_size)
    parts["experts"] = ParamCount(expert=_mlp(model, model.expert_ffn, training.etp) * (model.num_experts // training.ep))
    if model.moe_shared_expert_intermediate_size:
        parts["shared_expert"] = ParamCount(_mlp(model, model.moe_shared_expert_intermediate_size, tp))
    return parts


def embedding_params(model: ModelSpec, tp: int) -> int:
    positions = model.max_position_embeddings or model.seq_length
    learned = positions * model.hidden_size if model.position_embedding_type == "learned_absolute" else 0
    return model.padded_vocab(tp) * model.hidden_size // tp + learned


def head_params(model: ModelSpec, tp: int) -> int:
    """Final norm and output layer (a copy of the embedding when tied: see the module docstring)."""
    return _norm(model, model.hidden_size) + model.padded_vocab(tp) * model.hidden_size // tp


def layers_params(model: ModelSpec, training: TrainingSpec, layers: Iterable[int]) -> ParamCount:
    """The transformer layers ``layers`` (indices into the model's layers) on one (TP, EP) rank."""
    per_kind = {kind: sum(layer_params(model, training, kind).values(), ParamCount())
                for kind in set(model.layer_kinds)}
    return sum((per_kind[model.layer_kinds[i]] for i in layers), ParamCount())


def stage_params(model: ModelSpec, training: TrainingSpec, layout: StageLayout, stage: int) -> ParamCount:
    """Everything stage ``stage`` holds on one of its (TP, EP) ranks."""
    count = layers_params(model, training, layout.stage_layers[stage])
    if stage == 0:
        count += ParamCount(embedding_params(model, training.tp))
    if stage == layout.num_stages - 1:
        head = head_params(model, training.tp)
        if layout.num_stages == 1 and not model.untie_embeddings_and_output_weights:  # the embedding's own weight
            head -= model.padded_vocab(training.tp) * model.hidden_size // training.tp
        count += sum([mtp_params(model, training)] * (training.mtp_num_layers or 0), ParamCount(head))
        if training.mtp_num_layers and layout.num_stages > 1:  # the MTP input embeds tokens: a copy of the table
            count += ParamCount(embedding_params(model, training.tp))
    return count


def mtp_params(model: ModelSpec, training: TrainingSpec) -> ParamCount:
    """One multi-token-prediction module (DeepSeek-V3) on the last stage: two norms, the projection of the
    concatenated [hidden, embedding] (2H -> H, split over TP) and a transformer layer of the last layer's
    kind; it shares the output layer."""
    layer = sum(layer_params(model, training, model.layer_kinds[-1]).values(), ParamCount())
    h = model.hidden_size
    return layer + ParamCount(3 * _norm(model, h) + 2 * h * h // training.tp)


def rank_params(model: ModelSpec, training: TrainingSpec, layout: StageLayout) -> list[ParamCount]:
    """Parameters of each pipeline rank (all its chunks) on one of its (TP, EP) ranks."""
    return [sum((stage_params(model, training, layout, s) for s in layout.rank_stages(r)), ParamCount())
            for r in range(layout.placement.pp)]


def total_params(model: ModelSpec) -> int:
    """Unique parameters of the whole model (tied weights counted once, every expert)."""
    whole = TrainingSpec(pipeline_model_parallel_size=1, source="(whole model)")
    layers = sum(sum(layer_params(model, whole, kind).values(), ParamCount()).total for kind in model.layer_kinds)
    tied = 0 if model.untie_embeddings_and_output_weights else model.padded_vocab(1) * model.hidden_size
    return layers + embedding_params(model, 1) + head_params(model, 1) - tied


GEMM_PARTS = ("attention", "mlp", "shared_expert")
"""The dense parts of a layer (:func:`layer_params`) that are Transformer Engine GEMM weights: what FP8 weights
(``fp8_param_gather``) hold in FP8. The norms and the MoE router stay in BF16 (a ``TELayerNormColumnParallelLinear``'s
norm weight is not quantized; the router is a plain torch weight), as do megatron-core's own embedding and output
``ColumnParallelLinear``. (Biases and per-head q/k norms, both small, count with their GEMM part.)"""


@dataclass(frozen=True)
class DenseBuffer:
    """A pipeline rank's dense parameters as megatron-core's data-parallel buffers hold them.

    Under FP8 weights DDP keeps the FP8 weights in a ``torch.uint8`` buffer and the rest in a BF16 one
    (``distributed/distributed_data_parallel.py``, ``_allocate_buffers_for_parameters``); ``unquantized`` counts
    the BF16 one's parameters. ``weights`` and ``others`` count the tensors of each (the GEMM weights; norms,
    routers, the embedding and the output layer): a bucket closes only after a whole tensor, so they bound how
    many buckets a small ``bucket_size`` cuts a buffer into. (Biases, q/k norms and MTP modules' tensors are not
    counted: they matter only there.)"""

    unquantized: int = 0
    weights: int = 0
    others: int = 0


def _layer_gemm_weights(model: ModelSpec, kind: LayerKind) -> int:
    """GEMM weight tensors of one layer's dense parts (routed experts live in the expert buffers)."""
    if model.multi_latent_attention:
        attention = (1 if model.q_lora_rank is None else 2) + 3  # query (down/up), kv down, kv up, output
    else:
        attention = 2  # fused QKV, output
    if kind == "dense":
        return attention + 2
    return attention + (2 if model.moe_shared_expert_intermediate_size else 0)


def dense_buffer(model: ModelSpec, training: TrainingSpec, layout: StageLayout, rank: int) -> DenseBuffer:
    """:class:`DenseBuffer` of pipeline rank ``rank`` (all its chunks), on one of its (TP, EP) ranks."""
    gemm = {kind: sum(count.dense for name, count in layer_params(model, training, kind).items() if name in GEMM_PARTS)
            for kind in set(model.layer_kinds)}
    stages = layout.rank_stages(rank)
    layers = [model.layer_kinds[i] for s in stages for i in layout.stage_layers[s]]
    quantized = sum(gemm[kind] for kind in layers)
    if layout.num_stages - 1 in stages and training.mtp_num_layers:  # an MTP module: a layer and its H x 2H projection
        quantized += training.mtp_num_layers * (gemm[model.layer_kinds[-1]] + 2 * model.hidden_size ** 2 // training.tp)
    dense = sum(stage_params(model, training, layout, s).dense for s in stages)
    own_output = model.untie_embeddings_and_output_weights or layout.num_stages > 1
    ends = (0 in stages) + (1 + own_output) * (layout.num_stages - 1 in stages)  # embedding; final norm, output layer
    return DenseBuffer(unquantized=dense - quantized, weights=sum(_layer_gemm_weights(model, k) for k in layers),
                       others=sum(2 + (k == "moe") for k in layers) + ends)
