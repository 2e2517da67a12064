"""Real megatron-core modules built from the projection's specs: what the layer benchmark times and
what the tests hold the projection's formulas against.

Models are built with megatron-core's local (non-Transformer-Engine) layer spec and settings that run on
CPU as well as GPU: CPU initialisation, no fused kernels that need CUDA, the all-gather token dispatcher,
sequential (non-grouped) experts. ``bias_activation_fusion`` and dropout follow the training spec; the
attention backend and RoPE fusion do not: the local spec's attention is always the unfused
``DotProductAttention`` and its rotary embedding unfused (the fused ones need Transformer Engine).
"""

from __future__ import annotations

import torch

from primuspipe.projection.model_spec import LayerKind, ModelSpec
from primuspipe.projection.training_spec import TrainingSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def transformer_config(model: ModelSpec, training: TrainingSpec, *, stage_counts: tuple[int, ...] | None = None,
                       initialize: bool = True, **overrides):
    """Megatron's ``TransformerConfig`` (``MLATransformerConfig`` for multi-latent attention) for the
    specs. ``stage_counts`` (layers per stage, in stage order) becomes an explicit pipeline layout;
    ``initialize=False`` skips weight initialisation (for meta-device builds)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    dtype = DTYPES[training.precision]
    fields = dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.query_groups,
        kv_channels=model.head_dim, normalization=model.normalization, gated_linear_unit=model.swiglu,
        activation_func=torch.nn.functional.silu if model.swiglu else torch.nn.functional.gelu,
        add_bias_linear=model.add_bias_linear, add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
        attention_dropout=model.attention_dropout, hidden_dropout=model.hidden_dropout,
        tensor_model_parallel_size=training.tp, pipeline_model_parallel_size=training.pp,
        expert_model_parallel_size=training.ep, expert_tensor_parallel_size=training.etp,
        context_parallel_size=training.cp, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=training.precision == "bf16", fp16=training.precision == "fp16",
        attention_softmax_in_fp32=training.attention_softmax_in_fp32,
        bias_activation_fusion=training.bias_activation_fusion, use_cpu_initialization=True,
        transformer_impl="local", perform_initialization=initialize, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        batch_p2p_comm=False,
        recompute_granularity=training.recompute_granularity, recompute_method=training.recompute_method,
        recompute_num_layers=training.recompute_num_layers,
        recompute_modules=list(training.recompute_modules) if training.recompute_granularity == "selective" else None,
    )
    if stage_counts is not None and len(stage_counts) > 1:
        last = len(stage_counts) - 1
        fields["pipeline_model_parallel_layout"] = [
            (["embedding"] if s == 0 else []) + ["decoder"] * n + (["loss"] if s == last else [])
            for s, n in enumerate(stage_counts)]
    elif training.vpp > 1:
        fields["virtual_pipeline_model_parallel_size"] = training.vpp
    if model.is_moe:
        fields.update(
            num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.expert_ffn, moe_layer_freq=[int(k == "moe") for k in model.layer_kinds],
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size, moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_permute_fusion=False, moe_router_num_groups=model.moe_router_num_groups,
            moe_router_group_topk=model.moe_router_group_topk, moe_router_score_function=model.moe_router_score_function,
            moe_router_pre_softmax=model.moe_router_pre_softmax,
        )
    if model.multi_latent_attention:
        fields.update(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
                      qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim, rope_type="rope")
        fields.pop("kv_channels")
        return MLATransformerConfig(**{**fields, **overrides})
    return TransformerConfig(**{**fields, **overrides})


def layer_spec(model: ModelSpec, kind: LayerKind):
    """megatron-core's local ``TransformerLayer`` spec for one layer of ``kind``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=model.num_experts if kind == "moe" else None,
                                    qk_layernorm=model.qk_layernorm, multi_latent_attention=model.multi_latent_attention,
                                    normalization=model.normalization)


def build_layer(model: ModelSpec, training: TrainingSpec, kind: LayerKind, config=None) -> torch.nn.Module:
    """One transformer layer of ``kind`` in the training precision (as Megatron's ``Float16Module``
    casts it), on the current default device."""
    from megatron.core.transformer.spec_utils import build_module

    config = config or transformer_config(model, training)
    layer = build_module(layer_spec(model, kind), config=config, layer_number=1)
    return layer.to(DTYPES[training.precision])


def build_gpt_chunk(model: ModelSpec, training: TrainingSpec, config, *, vp_stage: int | None, pre_process: bool,
                    post_process: bool) -> torch.nn.Module:
    """One pipeline chunk of the whole model (``GPTModel``) under the current ``parallel_state``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=model.normalization,
                                      vp_stage=vp_stage)
    return GPTModel(config, spec, vocab_size=model.padded_vocab(training.tp),
                    max_sequence_length=model.max_position_embeddings or model.seq_length,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
                    position_embedding_type="rope" if model.rotary else model.position_embedding_type, vp_stage=vp_stage)


def rotary_embedding(model: ModelSpec, training: TrainingSpec) -> torch.Tensor | None:
    """The rotary table a layer receives from ``GPTModel`` (None without RoPE, and for MLA, which makes its own)."""
    if not model.rotary or model.multi_latent_attention:
        return None
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    # RotaryEmbedding.forward moves its table to the current CUDA device; its own math, on the host:
    rope = RotaryEmbedding(kv_channels=model.head_dim, rotary_percent=1.0, use_cpu_initialization=True)
    freqs = rope.get_freqs_non_repeated(model.seq_length // training.cp)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def causal_mask(seq_length: int) -> torch.Tensor:
    """An explicit causal mask (``True`` = masked): GPTModel's default one is built on CUDA."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1).view(1, 1, seq_length, seq_length)
