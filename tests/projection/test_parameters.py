"""Layer assignment and parameter counts: hand-computed values, published totals, and the parameters
megatron-core itself allocates on each pipeline rank (built on the meta device, any TP/PP/EP layout)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from projection_megatron import megatron_dense_buffers, megatron_rank_params

from primuspipe.projection.compute import model_flops_per_token
from primuspipe.projection.framework import Placement
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.layout import StageLayout, layer_counts
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.parameters import dense_buffer, layer_params, rank_params, total_params
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.static_memory import static_memory
from primuspipe.projection.training_spec import TrainingSpec, load_training

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
SHIPPED = ["llama2-7b", "llama3-70b", "mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v2-lite"]


def test_layer_split_remainder_goes_to_the_first_stages():
    assert layer_counts(61, pp=4, vpp=1) == (16, 15, 15, 15)
    assert layer_counts(61, pp=4, vpp=2) == (8, 8, 8, 8, 8, 7, 7, 7)
    assert layer_counts(32, pp=4, vpp=1) == (8, 8, 8, 8)


def test_explicit_first_and_last_stage_counts_follow_megatron():
    assert layer_counts(30, pp=4, vpp=1, first=6, last=8, placement=Placement.interleaved(4)) == (6, 8, 8, 8)
    # V placement: rank 0 holds stages 0 and 7, so its first-rank count covers both
    assert layer_counts(28, pp=4, vpp=2, first=4, placement=Placement.vshape(4)) == (2, 4, 4, 4, 4, 4, 4, 2)
    training = TrainingSpec(decoder_first_pipeline_num_layers=5, source="t.yaml")
    with pytest.raises(InputError, match="t.yaml: decoder_first_pipeline_num_layers=5.*must split evenly"):
        StageLayout.build(30, training, Placement.interleaved(4))


def test_layout_places_embedding_and_head():
    v = StageLayout.build(16, TrainingSpec(), Placement.vshape(4))
    assert (v.embedding_rank, v.head_rank) == (0, 0)
    loop = StageLayout.build(16, TrainingSpec(), Placement.interleaved(4, 2))
    assert (loop.embedding_rank, loop.head_rank) == (0, 3)
    assert [list(r) for r in loop.stage_layers[:2]] == [[0, 1], [2, 3]]


def test_hand_computed_dense_layer():
    # H = 64, a = 4, g = 2, d = 16, F = 160, SwiGLU, RMSNorm, no biases, TP 2
    model = ModelSpec(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
                      seq_length=8, vocab_size=100, swiglu=True, normalization="RMSNorm", add_bias_linear=False)
    parts = layer_params(model, TrainingSpec(tensor_model_parallel_size=2), "dense")
    assert parts["input_norm"].total == 64
    assert parts["attention"].total == 64 * (4 + 2 * 2) * 16 // 2 + 4 * 16 * 64 // 2
    assert parts["mlp"].total == (64 * 160 * 2 + 160 * 64) // 2


def test_hand_computed_moe_layer_and_sharding():
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=100, swiglu=True,
                      add_bias_linear=False, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                      moe_shared_expert_intermediate_size=48)
    parts = layer_params(model, TrainingSpec(expert_model_parallel_size=4, data_parallel_size=4), "moe")
    assert parts["router"].total == 8 * 64
    assert parts["experts"].expert == 2 * (64 * 32 * 2 + 32 * 64) and parts["experts"].dense == 0
    assert parts["shared_expert"].total == 64 * 48 * 2 + 48 * 64


@pytest.mark.parametrize("name, published", [
    ("llama2-7b", 6_738_415_616), ("llama3-70b", 70_553_706_496), ("mixtral-8x7b", 46_702_792_704),
    ("mixtral-8x22b", 140_620_634_112),
    ("qwen3-235b-a22b", 235_093_634_560), ("llama3-8b", 8_030_261_248), ("llama3.1-405b", 405_853_388_800),
    ("llama2-70b", 68_976_648_192), ("qwen3-30b-a3b", 30_532_122_624),
    # Mistral 7B v0.1: the released checkpoint's 7,241,732,096 (its sliding window does not change the count)
    ("mistral-7b-w1024", 7_241_732_096),
    # DeepSeek's release counts 15,706,484,224; megatron-core adds a norm (2048 weights) fused into each
    # layer's query projection when qk_layernorm is set without a query latent
    ("deepseek-v2-lite", 15_706_484_224 + 27 * 2048),
    # DeepSeek-V2: the released checkpoint's tensors (config.json shapes) sum to 235,741,434,880; with a query
    # latent the query norm is the checkpoint's q_a_layernorm, so megatron-core adds nothing
    ("deepseek-v2", 235_741_434_880),
])
def test_totals_match_the_published_models(name, published):
    assert total_params(load_model(EXAMPLES / "models" / f"{name}.yaml")) == published


def _shipped(name):
    model = load_model(EXAMPLES / "models" / f"{name}.yaml")
    path = EXAMPLES / "training" / f"{name}.yaml"
    return model, load_training(path if path.exists() else None)


@pytest.mark.parametrize("name", SHIPPED)
def test_per_rank_counts_equal_megatron_core(name):
    """Each shipped model under its shipped training layout (TP, PP, EP as in the file)."""
    model, training = _shipped(name)
    layout = StageLayout.build(model.num_layers, training, Placement.interleaved(training.pp, training.vpp))
    assert [p.total for p in rank_params(model, training, layout)] == megatron_rank_params(model, training, layout.counts)


SMALL_MODEL = ModelSpec(num_layers=8, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                        seq_length=16, vocab_size=250, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                        position_embedding_type="rope", untie_embeddings_and_output_weights=True)
"""The small dense model the layouts below vary and hold against megatron-core's own build."""


@pytest.mark.parametrize("model_change, training_change", [
    (dict(), dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)),
    (dict(num_layers=10, untie_embeddings_and_output_weights=False), dict(pipeline_model_parallel_size=3)),  # remainder
    # one stage: the output layer is built on the embedding's own weight
    (dict(untie_embeddings_and_output_weights=False), dict(pipeline_model_parallel_size=1)),
    (dict(untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute", vocab_size=50304),
     dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)),
    (dict(add_bias_linear=True, normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute"),
     dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3)),
    (dict(num_experts=8, moe_shared_expert_intermediate_size=64, moe_layer_freq=2),
     dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2, data_parallel_size=2,
          expert_tensor_parallel_size=1, pipeline_model_parallel_size=2)),
    (dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
          v_head_dim=16, qk_layernorm=True, position_embedding_type="rope"), dict(pipeline_model_parallel_size=2)),
])
def test_small_layouts_equal_megatron_core(model_change, training_change):
    """Tensor/expert sharding, tied embeddings across stages and on one, remainder and explicit uneven splits, MLA."""
    model = dataclasses.replace(SMALL_MODEL, **model_change)
    training = dataclasses.replace(TrainingSpec(), **training_change)
    layout = StageLayout.build(model.num_layers, training, Placement.interleaved(training.pp, training.vpp))
    assert [p.total for p in rank_params(model, training, layout)] == megatron_rank_params(model, training, layout.counts)


@pytest.mark.parametrize("model_change, training_change", [
    (dict(), dict(pipeline_model_parallel_size=1)),
    (dict(untie_embeddings_and_output_weights=False), dict(pipeline_model_parallel_size=1)),  # output = embedding
    (dict(untie_embeddings_and_output_weights=False), dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                                           virtual_pipeline_model_parallel_size=2)),
    (dict(num_experts=8, moe_shared_expert_intermediate_size=64, moe_layer_freq=2),
     dict(expert_model_parallel_size=2, data_parallel_size=2, pipeline_model_parallel_size=2)),
    (dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
          v_head_dim=16, position_embedding_type="rope"), dict(pipeline_model_parallel_size=2)),
])
def test_dense_buffers_split_as_megatron_core_builds_the_model(model_change, training_change):
    """What FP8 weights leave in BF16 (embedding, output layer, norms, router) and the tensors of each part, per
    rank, against the parameters megatron-core builds (bias-free models without q/k norms: those count with
    their GEMM part)."""
    model = dataclasses.replace(SMALL_MODEL, **model_change)
    training = dataclasses.replace(TrainingSpec(), **training_change)
    layout = StageLayout.build(model.num_layers, training, Placement.interleaved(training.pp, training.vpp))
    ours = [dense_buffer(model, training, layout, r) for r in range(training.pp)]
    assert [(b.unquantized, b.weights, b.others) for b in ours] == megatron_dense_buffers(model, training, layout.counts)


def test_static_bytes_follow_megatron_mixed_precision():
    from primuspipe.projection.parameters import ParamCount

    params = ParamCount(dense=1000, expert=800)
    dist = TrainingSpec(data_parallel_size=4, expert_model_parallel_size=2)
    memory = static_memory(params, dist)
    assert (memory.weights, memory.gradients) == (2 * 1800, 4 * 1800)
    assert memory.optimizer == 12 * 1000 / 4 + 12 * 800 / 2  # experts shard over DP / EP = 2 ranks
    plain = static_memory(params, dataclasses.replace(dist, use_distributed_optimizer=False))
    assert plain.total == 18 * 1800
    fp32 = static_memory(params, dataclasses.replace(dist, use_distributed_optimizer=False, precision="fp32"))
    assert fp32.total == 16 * 1800


def test_megatron_fsdp_optim_grads_shards_the_main_gradients_too():
    from primuspipe.projection.parameters import ParamCount

    params = ParamCount(dense=1000, expert=800)
    zero2 = TrainingSpec(data_parallel_size=4, expert_model_parallel_size=2, use_megatron_fsdp=True,
                         data_parallel_sharding_strategy="optim_grads")
    memory = static_memory(params, zero2)
    assert memory.gradients == 4 * (1000 / 4 + 800 / 2) and memory.weights == 2 * 1800
    assert memory.optimizer == 12 * 1000 / 4 + 12 * 800 / 2
    optim = static_memory(params, dataclasses.replace(zero2, data_parallel_sharding_strategy="optim"))
    assert optim.gradients == 4 * 1800  # optim shards the optimizer state only


def test_megatron_fsdp_optim_grads_params_shards_the_weights_and_holds_two_gathered_layers():
    from primuspipe.projection.parameters import ParamCount

    params = ParamCount(dense=1000, expert=800)
    zero3 = TrainingSpec(data_parallel_size=4, expert_model_parallel_size=2, use_megatron_fsdp=True,
                         data_parallel_sharding_strategy="optim_grads_params")
    memory = static_memory(params, zero3, layers=6)
    assert memory.weights == pytest.approx(2 * (1000 / 4 + 800 / 2 + 2 * 1800 / 6))  # shard + two layers gathered
    assert memory.gradients == 4 * (1000 / 4 + 800 / 2)
    assert static_memory(params, zero3, layers=1).weights == 2 * 1800  # never more than the unsharded weights


def test_pytorch_fsdp_keeps_no_bf16_shard_beside_the_fp32_one_the_optimizer_updates():
    """torch FSDP (FSDP1 with a bf16 ``MixedPrecision``, FSDP2 with a bf16 ``MixedPrecisionPolicy``) shards the
    fp32 parameters themselves and casts to bf16 only what it gathers; Megatron-FSDP keeps bf16 model weights
    apart from its fp32 main weights. The layers gathered are the same."""
    from primuspipe.projection.parameters import ParamCount

    params = ParamCount(dense=1000, expert=800)
    megatron = TrainingSpec(data_parallel_size=4, expert_model_parallel_size=2, use_megatron_fsdp=True,
                            data_parallel_sharding_strategy="optim_grads_params")
    torch_fsdp = dataclasses.replace(megatron, fsdp_implementation="torch")
    ours, theirs = static_memory(params, torch_fsdp, layers=6), static_memory(params, megatron, layers=6)
    assert ours.weights == pytest.approx(2 * 2 * 1800 / 6)  # the two gathered layers alone
    assert theirs.weights - ours.weights == pytest.approx(2 * (1000 / 4 + 800 / 2))  # Megatron-FSDP's bf16 shard
    assert (ours.gradients, ours.optimizer) == (theirs.gradients, theirs.optimizer)


def test_fsdp2_without_reshard_after_forward_holds_every_gathered_layer_and_under_pipelining_whole_gradients():
    """FSDP2's reshard_after_forward off (torchtitan under PP) keeps every layer's gathered weights from forward to
    backward; under PyTorch's pipelining the stage's gradients stay unsharded in the reduce dtype (fp32) for the
    step, as PipelineStage turns FSDP2's gradient reduction off until the last microbatch. The optimizer state
    stays sharded."""
    from primuspipe.projection.parameters import ParamCount

    params = ParamCount(dense=1000, expert=800)
    resharding = TrainingSpec(data_parallel_size=4, expert_model_parallel_size=2, use_megatron_fsdp=True,
                              data_parallel_sharding_strategy="optim_grads_params", fsdp_implementation="torch",
                              pipeline_model_parallel_size=1)
    kept = dataclasses.replace(resharding, fsdp_reshard_after_forward=False)
    piped = dataclasses.replace(kept, pipeline_model_parallel_size=2)
    before, pp1, pp2 = (static_memory(params, t, layers=6) for t in (resharding, kept, piped))
    assert (pp1.weights, pp2.weights) == (2 * 1800, 2 * 1800)  # every layer gathered, in bf16
    assert pp1.gradients == before.gradients == 4 * (1000 / 4 + 800 / 2)  # reduce-scattered as backward runs
    assert pp2.gradients == 4 * 1800  # whole fp32 gradients until the step's last backward
    assert before.optimizer == pp1.optimizer == pp2.optimizer
    assert (kept.gathered_for_step, piped.gathered_for_step, piped.shards_gradients) == (False, True, False)


def test_fsdp2_without_reshard_after_forward_gathers_once_a_microbatch_and_under_pipelining_once_a_step():
    """The weight all-gathers and gradient reduce-scatters, nothing overlapped: with resharding each of the 8
    microbatches gathers twice (forward and backward) and reduces once; without, it gathers once; under PyTorch's
    pipelining the step gathers once and reduces its whole fp32 gradients once."""
    from primuspipe.projection.comm import Collectives, gradient_sync
    from primuspipe.projection.hardware_spec import load_hardware
    from primuspipe.projection.parameters import ParamCount

    hardware = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    net, params = Collectives(hardware), ParamCount(dense=1e9, expert=0)
    base = TrainingSpec(data_parallel_size=8, global_batch_size=8 * 8, use_megatron_fsdp=True,
                        data_parallel_sharding_strategy="optim_grads_params", fsdp_implementation="torch",
                        overlap_param_gather=False, overlap_grad_reduce=False, pipeline_model_parallel_size=1)
    gather, reduce = net.gather(2e9, 8, 8), net.gather(4e9, 8, 8)
    twice, once = (gradient_sync(params, dataclasses.replace(base, fsdp_reshard_after_forward=flag), hardware)
                   for flag in (True, False))
    assert (twice, once) == (pytest.approx(8 * (2 * gather + reduce)), pytest.approx(8 * (gather + reduce)))
    piped = dataclasses.replace(base, fsdp_reshard_after_forward=False, pipeline_model_parallel_size=2)
    assert gradient_sync(params, piped, hardware) == pytest.approx(gather + reduce)


def test_fsdp_reshard_after_forward_is_pytorch_fsdp2s_setting():
    from primuspipe.projection.spec_fields import spec_from_mapping

    values = {"data_parallel_size": 4, "use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params",
              "fsdp_reshard_after_forward": False}
    with pytest.raises(InputError, match="fsdp_reshard_after_forward"):
        spec_from_mapping(TrainingSpec, values, "t.yaml")
    assert not spec_from_mapping(TrainingSpec, {**values, "fsdp_implementation": "torch"}, "t.yaml").fsdp_reshard_after_forward


def test_pytorch_fsdp_keeps_its_root_gathered_beside_two_layers():
    """Each layer wrapped alone, the root unit holds the embedding, final norm and output layer, and torch's FSDP
    does not reshard the root after the forward (FSDP1 ``_post_forward_reshard``; FSDP2 ``_lazy_init`` before
    pytorch#154704): those weights are gathered whole with the two layers. Megatron-FSDP's count is unchanged."""
    from primuspipe.projection.parameters import ParamCount

    params = ParamCount(dense=1000 + 600)  # six layers of 1000 / 6 and 600 outside them
    megatron = TrainingSpec(data_parallel_size=4, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    torch_fsdp = dataclasses.replace(megatron, fsdp_implementation="torch")
    assert static_memory(params, torch_fsdp, layers=6, outside_layers=600).weights == pytest.approx(2 * (2 * 1000 / 6 + 600))
    assert static_memory(params, megatron, layers=6, outside_layers=600) == static_memory(params, megatron, layers=6)


@pytest.mark.parametrize("fsdp,global_batch,made_in_backward", [
    ("torch", 4, True), ("torch", 8, False), ("megatron", 4, False)])
def test_only_torch_fsdp_with_one_microbatch_makes_its_gradients_in_the_backward(fsdp, global_batch, made_in_backward):
    """torchtitan frees the gradients as each step begins (``zero_grad``, ``set_to_none``) and FSDP2 makes a
    layer's shard at its reduce-scatter (``tests/projection/test_torch_fsdp_gradients.py`` runs it); a second
    microbatch's forward holds the first one's, and Megatron's gradient buffers stay allocated."""
    from primuspipe.projection.parameters import ParamCount

    training = TrainingSpec(data_parallel_size=4, micro_batch_size=1, global_batch_size=global_batch, use_megatron_fsdp=True,
                            data_parallel_sharding_strategy="optim_grads_params", fsdp_implementation=fsdp)
    assert training.gradients_from_backward is made_in_backward
    memory = static_memory(ParamCount(dense=1000), training, layers=4)
    assert memory.total == memory.weights + memory.gradients + memory.optimizer
    assert memory.beside_activations == memory.total - (memory.gradients if made_in_backward else 0)


def test_gradients_made_in_the_backward_leave_the_activations_peak_and_peak_at_its_end():
    """The verdict's peak is the larger of the two moments: every activation beside weights and optimizer state,
    or the end of the backward, every gradient and no activation. A second microbatch's forward holds the
    first one's gradients."""
    from primuspipe.projection.projection import Projector

    model, hardware = load_model(EXAMPLES / "models" / "llama2-7b.yaml"), load_hardware(EXAMPLES / "hardware" / "mi300x.yaml")
    torch_fsdp = TrainingSpec(data_parallel_size=8, micro_batch_size=1, global_batch_size=8, use_megatron_fsdp=True,
                              data_parallel_sharding_strategy="optim_grads_params", fsdp_implementation="torch")
    one, two = (Projector(model, hardware).evaluate(dataclasses.replace(torch_fsdp, global_batch_size=g), "1f1b")
                for g in (8, 16))
    gradients = two.memory_breakdown["gradients"]
    assert one.memory_breakdown["gradients"] == 0 and gradients > 0
    assert one.memory_breakdown["activations"] + one.memory_breakdown["recompute_working_set"] > gradients
    assert max(one.peak_memory_bytes) == pytest.approx(sum(one.memory_breakdown.values()))
    short = dataclasses.replace(model, seq_length=16)  # activations smaller than the gradients: the end of the backward
    end = Projector(short, hardware).evaluate(torch_fsdp, "1f1b")
    parts = end.memory_breakdown
    assert parts["gradients"] == pytest.approx(gradients, rel=1e-5) and parts["activations"] == parts["recompute_working_set"] == 0
    assert max(end.peak_memory_bytes) == pytest.approx(sum(parts.values()))


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_pytorch_fsdp_is_refused_where_it_would_not_shard_the_weights(strategy):
    from primuspipe.projection.spec_fields import spec_from_mapping

    values = {"data_parallel_size": 4, "fsdp_implementation": "torch", "data_parallel_sharding_strategy": strategy}
    if strategy != "no_shard":
        values["use_megatron_fsdp"] = True
    with pytest.raises(InputError, match="fsdp_implementation"):
        spec_from_mapping(TrainingSpec, values, "t.yaml")


@pytest.mark.parametrize("values,field", [
    ({"data_parallel_sharding_strategy": "optim_grads"}, "use_megatron_fsdp"),
    ({"data_parallel_sharding_strategy": "optim_grads", "use_megatron_fsdp": True, "use_distributed_optimizer": False},
     "use_distributed_optimizer"),
    ({"data_parallel_sharding_strategy": "optim_grads_param", "use_megatron_fsdp": True},
     "data_parallel_sharding_strategy")])
def test_a_sharding_strategy_without_megatron_fsdp_or_one_megatron_lacks_is_refused(values, field):
    from primuspipe.projection.spec_fields import spec_from_mapping

    with pytest.raises(InputError, match=field):
        spec_from_mapping(TrainingSpec, {"data_parallel_size": 4, **values}, "t.yaml")


def test_bf16_gradient_reduction_keeps_two_byte_main_gradients():
    from primuspipe.projection.parameters import ParamCount

    params = ParamCount(dense=1000)
    bf16 = TrainingSpec(data_parallel_size=4, grad_reduce_in_bf16=True)
    assert bf16.main_grad_bytes == 2 and static_memory(params, bf16).gradients == 2 * 1000
    with pytest.raises(InputError, match="grad_reduce_in_bf16"):
        TrainingSpec(data_parallel_size=4, grad_reduce_in_bf16=True, precision="fp32", use_distributed_optimizer=False)


def test_nemotron4_340b_matches_the_reports_embedding_and_non_embedding_counts():
    """The Nemotron-4 340B report gives 9.4B embedding and 331.6B non-embedding parameters (to 0.1B)."""
    model = load_model(EXAMPLES / "models" / "nemotron4-340b.yaml")
    embedding = 2 * model.vocab_size * model.hidden_size  # untied input embedding and output layer
    assert round(embedding / 1e9, 1) == 9.4
    assert round((total_params(model) - embedding) / 1e9, 1) == 331.6


def test_nemotron4_15b_matches_the_reports_non_embedding_count():
    """The Nemotron-4 15B report gives 12.5B non-embedding parameters; a gated MLP or no grouped-query
    attention (48 key/value heads) would count 17.3B or 14.5B."""
    model = load_model(EXAMPLES / "models" / "nemotron4-15b.yaml")
    embedding = 2 * model.vocab_size * model.hidden_size  # untied input embedding and output layer
    assert round((total_params(model) - embedding) / 1e9, 1) == 12.5


def test_gpt_oss_20b_and_kimi_k2_match_their_published_totals():
    """The gpt-oss model card gives gpt-oss-20b 20.91B parameters (to 0.01B); Kimi K2's README gives 1T. Tied
    embeddings would take 0.58B off the 20B model; DeepSeek-V3's 256 experts instead of Kimi's 384 would leave 0.69T."""
    assert round(total_params(load_model(EXAMPLES / "models" / "gpt-oss-20b.yaml")) / 1e9, 2) == 20.91
    assert round(total_params(load_model(EXAMPLES / "models" / "kimi-k2.yaml")) / 1e12, 1) == 1.0


@pytest.mark.parametrize("size, billions", [
    ("1.7b", 1.7), ("7.1b", 7.1), ("16b", 16), ("32b", 32), ("70b", 70), ("119b", 119), ("177b", 177),
    ("314b", 314), ("462b", 462)])
def test_megatron_core_weak_scaling_models_match_the_readme_sizes(size, billions):
    """The Megatron-LM README's weak-scaling table names each GPT by its size to two or three figures; the
    1.7B one counts 1.754B (the README truncates), every other one rounds to its name. Tied embeddings or a
    gated MLP would miss by 1.5 % or more (checked on the 177B: 175.6B tied)."""
    count = total_params(load_model(EXAMPLES / "models" / f"mcore08-gpt-{size}.yaml")) / 1e9
    digits = 1 if "." in size else 0
    shown = int(count * 10) / 10 if size == "1.7b" else round(count, digits)
    assert shown == billions


@pytest.mark.parametrize("name, tflops, tokens", [
    ("nemotron3-8b", 643, 12507), ("nemotron3-22b", 562, 4312), ("nemotron4-340b", 686, 326),
    ("nemotron4-15b", 1387, 14760)])
def test_nemotron_flops_per_token_match_nemos_own_figures(name, tflops, tokens):
    """NeMo's performance table gives both model TFLOP/s and tokens/s per GPU for each Nemotron run: their
    quotient is NeMo's FLOPs per token (full attention square), an independent check of the model files."""
    ours = model_flops_per_token(load_model(EXAMPLES / "models" / f"{name}.yaml"), "full")
    assert ours == pytest.approx(tflops * 1e12 / tokens, rel=2e-3)
