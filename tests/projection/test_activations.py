"""Activation bytes: hand-computed values, and the bytes autograd really saves in megatron-core layers
on CPU (same dtype, the local spec's unfused attention), for dense and MoE layers and every recompute
mode, within 5 %."""

from __future__ import annotations

import dataclasses

import pytest
from projection_megatron import block_saved_bytes, model_saved_bytes

from primuspipe.projection.activations import ActivationModel
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.training_spec import TrainingSpec

GB, GIB = 1e9, 2**30

# small stand-ins with the shipped models' structure: grouped-query attention, SwiGLU, RoPE, no biases;
# LayerNorm, whose CPU kernel saves what fused GPU norms save (CPU RMSNorm is decomposed into fp32 ops)
DENSE = ModelSpec(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
                  seq_length=32, vocab_size=256, swiglu=True, normalization="LayerNorm", add_bias_linear=False,
                  position_embedding_type="rope", untie_embeddings_and_output_weights=True)
MOE = dataclasses.replace(DENSE, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48,
                          moe_shared_expert_intermediate_size=96, moe_layer_freq=(0, 1))
GPT2_LIKE = dataclasses.replace(DENSE, swiglu=False, add_bias_linear=True, num_query_groups=None,
                                position_embedding_type="learned_absolute")
QK_NORM = dataclasses.replace(DENSE, qk_layernorm=True)
# what megatron-core's local spec runs on CPU
CPU = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=2, attention_backend="local",
                   bias_activation_fusion=False, apply_rope_fusion=False)
RECOMPUTE = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective"),
    "selective mlp+moe": dict(recompute_granularity="selective", recompute_modules=("mlp", "moe")),
    "selective shared_experts": dict(recompute_granularity="selective", recompute_modules=("shared_experts",)),
    "full uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "partial (full block, 1 of 2 layers)": dict(recompute_granularity="full", recompute_method="block",
                                               recompute_num_layers=1),
}


def _relative_error(model: ModelSpec, training: TrainingSpec) -> float:
    real = block_saved_bytes(model, training, list(model.layer_kinds))
    projected = sum(ActivationModel(model, training).layer_bytes(range(model.num_layers)))
    return projected / real - 1


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_layer_bytes_match_saved_tensors(model, recompute):
    assert abs(_relative_error(model, dataclasses.replace(CPU, **RECOMPUTE[recompute]))) <= 0.05


@pytest.mark.parametrize("model, change", [
    (GPT2_LIKE, {}), (GPT2_LIKE, dict(recompute_granularity="selective")),
    (QK_NORM, {}), (QK_NORM, dict(recompute_granularity="selective")),
    (DENSE, dict(precision="fp32")), (DENSE, dict(attention_softmax_in_fp32=False)),
    (DENSE, dict(tensor_model_parallel_size=2)),
], ids=["gelu-bias-mha", "gelu-bias-mha-selective", "qk-norm", "qk-norm-selective", "fp32", "bf16-softmax", "tp2"])
def test_variants_match_saved_tensors(model, change):
    assert abs(_relative_error(model, dataclasses.replace(CPU, **change))) <= 0.05


@pytest.mark.parametrize("model", [DENSE, GPT2_LIKE], ids=["rope-untied", "learned-positions"])
def test_whole_stage_with_embedding_and_head_matches_saved_tensors(model):
    activations = ActivationModel(model, CPU)
    projected = sum(activations.layer_bytes(range(model.num_layers))) + activations.embedding() + activations.head()
    assert projected == pytest.approx(model_saved_bytes(model, CPU), rel=0.05)


def test_moe_mlp_hand_computed_example():
    """MBS 4, S 16384, CP 4, H 8192, F_e 2048, top-36 routing, one shared expert of the same width, fused
    SwiGLU, bf16: T (k + 1) (H + 3 F_e) 2 bytes with T = 4 * 16384 / 4 tokens."""
    model = ModelSpec(num_layers=1, hidden_size=8192, num_attention_heads=64, seq_length=16384, vocab_size=1000,
                      swiglu=True, num_experts=256, moe_router_topk=36, moe_ffn_hidden_size=2048,
                      moe_shared_expert_intermediate_size=2048)
    training = TrainingSpec(micro_batch_size=4, context_parallel_size=4, pipeline_model_parallel_size=1)
    moe_mlp = ActivationModel(model, training).layer("moe").components["moe_mlp"]
    assert moe_mlp == 16384 * 37 * (8192 + 3 * 2048) * 2
    assert round(moe_mlp / GB, 2) == 17.38 and round(moe_mlp / GIB, 2) == 16.19


def test_flash_attention_hand_computed():
    """Flash keeps Q, K, V (grouped), the output and fp32 log-sum-exp rows; TP divides heads, SP the
    residual stream."""
    model = ModelSpec(num_layers=1, hidden_size=4096, num_attention_heads=32, num_query_groups=8, seq_length=4096,
                      vocab_size=1000, swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                      normalization="RMSNorm")
    training = TrainingSpec(micro_batch_size=1, tensor_model_parallel_size=4, sequence_parallel=True,
                            pipeline_model_parallel_size=1)
    t, d = 4096, 128
    parts = ActivationModel(model, training).layer("dense").components
    qkv_input = t // 4 * 4096 * 2
    core = t * (32 + 2 * 8) // 4 * d * 2 + 32 // 4 * t * 4
    output = t * 32 // 4 * d * 2
    assert parts["attention"] == qkv_input + core + output
    assert parts["input_norm"] == t // 4 * (4096 * 2 + 4)
    assert parts["mlp"] == t // 4 * 4096 * 2 + t * (2 * model.ffn + model.ffn) // 4 * 2


def test_full_recompute_keeps_one_input_per_group():
    model = dataclasses.replace(DENSE, num_layers=5)
    uniform = ActivationModel(model, dataclasses.replace(CPU, recompute_granularity="full", recompute_method="uniform",
                                                         recompute_num_layers=2))
    hidden = 2 * 32 * 64 * 2
    assert uniform.layer_bytes(range(5)) == [hidden, 0, hidden, 0, hidden]
    assert uniform.recomputed(range(5)) == [True] * 5
    assert uniform.recompute_working_set(range(5)) == 2 * uniform.layer("dense").total
    block = ActivationModel(model, dataclasses.replace(CPU, recompute_granularity="full", recompute_method="block",
                                                       recompute_num_layers=2))
    assert block.recomputed(range(5)) == [True, True, False, False, False]
    assert block.layer_bytes(range(5))[:3] == [hidden, hidden, block.layer("dense").total]


def test_sync_free_stage_3_keeps_the_experts_tensors_at_their_worst_case_rows():
    """Stage 3 sizes the permuted tokens for every token of the EP group going to this rank
    (``permute_max_token_num``): the routed experts' kept tensors grow EP-fold; stages 1 and 2 keep the copies."""
    base = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=4, data_parallel_size=4,
                        micro_batch_size=2, global_batch_size=8, moe_router_dtype="fp32", enable_primus_turbo=True)
    def routed(**fields):
        model = dataclasses.replace(MOE, moe_shared_expert_intermediate_size=None)
        training = dataclasses.replace(base, **fields)
        return ActivationModel(model, training).layer("moe").components["moe_mlp"]
    plain = routed()
    assert routed(turbo_sync_free_moe_stage=1) == plain
    assert routed(turbo_sync_free_moe_stage=2, use_turbo_grouped_gemm=True) == plain
    assert routed(turbo_sync_free_moe_stage=3, use_turbo_grouped_gemm=True) == pytest.approx(4 * plain)
