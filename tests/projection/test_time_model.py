"""The time model against hand-computed values: GEMM and attention FLOPs per pass, recompute's extra
forward, collective costs and where they fall, and the stage costs the simulator receives."""

from __future__ import annotations

import dataclasses

import pytest
from aten_bytes import byte_counter

from primuspipe.projection.comm import Collectives, gradient_sync, layer_comm, p2p_message_bytes, pipeline_ranks_per_node
from primuspipe.projection.compute import Calibration, PassWork, Work, WorkModel, part_times
from primuspipe.projection.framework import Placement
from primuspipe.projection.hardware_spec import HardwareSpec, load_hardware
from primuspipe.projection.host import moe_small_kernels
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.parameters import DenseBuffer, ParamCount
from primuspipe.projection.projection import Projector
from primuspipe.projection.published import EXAMPLES
from primuspipe.projection.spec_fields import InputError, spec_from_mapping
from primuspipe.projection.stage_costs import stage_costs
from primuspipe.projection.training_spec import TrainingSpec

MODEL = ModelSpec(num_layers=4, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8, seq_length=2048,
                  vocab_size=32000, make_vocab_size_divisible_by=128, swiglu=False, add_bias_linear=False,
                  normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True)
TRAINING = TrainingSpec(micro_batch_size=2, pipeline_model_parallel_size=2, global_batch_size=16)
HW = HardwareSpec(name="test", peak_bf16_tflops=100.0, achievable_fraction=0.5, hbm_bytes=80e9,
                  hbm_bandwidth_bytes_per_s=2e12, memory_bandwidth_fraction=0.5, intra_node_bandwidth_bytes_per_s=100e9,
                  inter_node_bandwidth_bytes_per_s=10e9, intra_node_latency_s=1e-5, inter_node_latency_s=2e-5,
                  network_efficiency=1.0, gpus_per_node=8)


def test_layer_flops_per_pass():
    t = 2 * 2048  # tokens of one microbatch
    h, f, s = 1024, 4096, 2048
    layer = WorkModel(MODEL, TRAINING).layer("dense")
    gemm = 2 * t * (3 * h * h + h * h + 2 * h * f)  # QKV, output, up and down projections
    assert layer.forward.gemm_flops == layer.backward_input.gemm_flops == layer.backward_weight.gemm_flops == gemm
    causal = 0.5 * 2 * 2 * 2 * s * s * h  # QK^T and PV over a, d (a * d = h), causal half
    assert layer.forward.attention_flops == causal  # flash skips masked tiles
    assert layer.backward_input.attention_flops == 2.5 * causal  # ... and recomputes the scores backward
    assert layer.backward_weight.attention_flops == 0
    unfused = WorkModel(MODEL, dataclasses.replace(TRAINING, attention_backend="unfused")).layer("dense")
    assert unfused.forward.attention_flops == 2 * causal and unfused.backward_input.attention_flops == 4 * causal
    local = WorkModel(MODEL, dataclasses.replace(TRAINING, attention_backend="local")).layer("dense")  # batched GEMMs
    assert local.forward.attention_flops == local.backward_input.attention_flops == 0
    assert local.forward.gemm_flops == gemm + 2 * causal and local.backward_input.gemm_flops == gemm + 4 * causal


def test_model_flops_count_three_passes_and_causal_attention_once():
    work = WorkModel(MODEL, TRAINING)
    layer, head = work.layer("dense"), work.head()
    per_layer = 3 * layer.forward.gemm_flops + 3 * layer.forward.attention_flops
    assert work.model_flops() == pytest.approx(4 * per_layer + 3 * head.forward.gemm_flops)
    local = WorkModel(MODEL, dataclasses.replace(TRAINING, attention_backend="local"))
    assert local.model_flops() == pytest.approx(work.model_flops())  # the unfused kernel's waste is not model FLOPs


def test_times_from_throughput_and_recompute_in_backward():
    parts = part_times(WorkModel(MODEL, TRAINING), HW, Calibration())
    layer = WorkModel(MODEL, TRAINING).layer("dense")
    flops_per_s, bytes_per_s = 100e12 * 0.5, 2e12 * 0.5
    assert parts["dense"].backward_weight == pytest.approx(layer.backward_weight.gemm_flops / flops_per_s)
    assert parts["dense"].forward == pytest.approx(
        (layer.forward.gemm_flops + layer.forward.attention_flops) / flops_per_s + layer.forward.memory_bytes / bytes_per_s)
    selective = dataclasses.replace(TRAINING, recompute_granularity="selective")
    assert part_times(WorkModel(MODEL, selective), HW, Calibration())["dense"].recompute == pytest.approx(
        layer.forward.attention_flops / flops_per_s)
    scaled = part_times(WorkModel(MODEL, TRAINING), HW, Calibration({("dense", "forward"): 2.0}))
    assert scaled["dense"].forward == pytest.approx(2 * parts["dense"].forward)
    assert scaled["dense"].backward_input == pytest.approx(parts["dense"].backward_input)


def test_full_recompute_adds_the_forward_to_b():
    plain = stage_costs(MODEL, TRAINING, HW, part_times(WorkModel(MODEL, TRAINING), HW, Calibration()),
                        Placement.interleaved(2))
    full = dataclasses.replace(TRAINING, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    again = stage_costs(MODEL, full, HW, part_times(WorkModel(MODEL, full), HW, Calibration()), Placement.interleaved(2))
    parts = part_times(WorkModel(MODEL, TRAINING), HW, Calibration())
    assert again.backward_input[1] - plain.backward_input[1] == pytest.approx(2 * parts["dense"].forward)
    assert again.forward == plain.forward and again.backward_weight == plain.backward_weight
    assert again.activation_bytes[1] < plain.activation_bytes[1] and again.transient_bytes[1] > 0


def test_ring_collectives_and_link_choice():
    net = Collectives(HW)
    assert net.gather(8e9, 8, 8) == pytest.approx(7 / 8 * 8e9 / 100e9 + 7 * 1e-5)  # one node: the fabric
    # across nodes a ring's traffic leaves through the cards of the group's members on each node: one member
    # a node (a strided group) has one card, four members a node four cards, up to the node's fabric
    assert net.gather(8e9, 8, 64) == pytest.approx(7 / 8 * 8e9 / 10e9 + 7 * 2e-5)
    assert net.gather(8e9, 8, 16) == pytest.approx(7 / 8 * 8e9 / (4 * 10e9) + 7 * 2e-5)
    assert net.gather(8e9, 64, 64) == pytest.approx(63 / 64 * 8e9 / 80e9 + 63 * 2e-5)
    assert net.all_reduce(8e9, 8, 8) == pytest.approx(2 * net.gather(8e9, 8, 8))
    assert net.gather(8e9, 1, 1) == 0


def test_where_tensor_context_and_expert_parallel_collectives_fall():
    c = layer_comm(MODEL, TRAINING, HW, "dense")
    assert (c.forward, c.backward_input, c.backward_weight) == (0, 0, 0)  # nothing to talk about at TP = CP = EP = 1
    tp = dataclasses.replace(TRAINING, tensor_model_parallel_size=4, sequence_parallel=True)
    comm = layer_comm(MODEL, tp, HW, "dense")
    activation = 2 * 2048 * 1024 * 2
    per_all_reduce = Collectives(HW).all_reduce(activation, 4, 4)
    assert comm.forward == pytest.approx(2 * per_all_reduce) == pytest.approx(comm.backward_input)
    assert comm.backward_weight == pytest.approx(2 * Collectives(HW).gather(activation, 4, 4))  # W re-gathers inputs
    moe = dataclasses.replace(MODEL, num_experts=8, moe_router_topk=2)
    ep = dataclasses.replace(TRAINING, expert_model_parallel_size=8, data_parallel_size=8, global_batch_size=64)
    a2a = 2 * Collectives(HW).gather(2 * 2048 * 2 * 1024 * 2, 8, 8)  # dispatch + combine of the token copies
    assert layer_comm(moe, ep, HW, "moe").forward == pytest.approx(a2a)


def test_pipeline_link_and_gradient_sync():
    assert p2p_message_bytes(MODEL, TRAINING) == 2 * 2048 * 1024 * 2
    assert pipeline_ranks_per_node(TRAINING, HW) == 8
    assert pipeline_ranks_per_node(dataclasses.replace(TRAINING, tensor_model_parallel_size=8), HW) == 1
    params = ParamCount(dense=10**9)
    dp = dataclasses.replace(TRAINING, data_parallel_size=8, global_batch_size=32)
    net = Collectives(HW)
    # distributed optimizer: the fp32 gradient reduce-scatter hides behind the last microbatch's backward but
    # for its last bucket (one per layer); the bf16 gather is exposed unless overlap_param_gather hides all but
    # its first bucket under the first microbatch's forward
    long = dict(forward_s=10.0, backward_s=10.0)
    assert gradient_sync(params, dp, HW, buckets=4, **long) == pytest.approx(
        net.gather(2e9, 8, 8) + net.gather(4e9, 8, 8) / 4)
    both = dataclasses.replace(dp, overlap_param_gather=True)
    assert gradient_sync(params, both, HW, buckets=4, **long) == pytest.approx(
        (net.gather(2e9, 8, 8) + net.gather(4e9, 8, 8)) / 4)
    exposed = dataclasses.replace(dp, overlap_grad_reduce=False)
    assert gradient_sync(params, exposed, HW) == pytest.approx(net.gather(4e9, 8, 8) + net.gather(2e9, 8, 8))
    plain = dataclasses.replace(exposed, use_distributed_optimizer=False)
    assert gradient_sync(params, plain, HW) == pytest.approx(net.all_reduce(4e9, 8, 8))


FP8_DP = dataclasses.replace(TRAINING, data_parallel_size=8, global_batch_size=32, overlap_param_gather=True,
                             fp8_format="e4m3", fp8_param_gather=True)
BF16_BESIDE_FP8 = DenseBuffer(unquantized=2 * 10**8, weights=40, others=10)
"""A rank of 1e9 dense parameters (as below) of which 2e8 stay in BF16 beside the FP8 weights."""


def test_fp8_weights_bf16_buffer_is_reduced_last_and_gathered_first_on_the_first_rank():
    """megatron-core merges the BF16 buffer's buckets (embedding, output layer, norms) into the last FP8 bucket
    group: on the pipeline's first rank it is reduced after the whole backward and gathered before the first
    forward, however long the compute; elsewhere only the last bucket shows. BF16 weights gather two bytes."""
    params, net, long = ParamCount(dense=10**9), Collectives(HW), dict(forward_s=10.0, backward_s=10.0)
    reduce, gather = net.gather(4e9, 8, 8), net.gather(0.8e9 + 2 * 0.2e9, 8, 8)  # fp32 main gradients
    first = gradient_sync(params, FP8_DP, HW, buckets=4, buffer=BF16_BESIDE_FP8, first_rank=True, **long)
    assert first == pytest.approx(0.2 * reduce + 0.8 * reduce / 4 + gather / 3 + (2 / 3) * gather / 4)
    later = gradient_sync(params, FP8_DP, HW, buckets=4, buffer=BF16_BESIDE_FP8, **long)
    assert later == pytest.approx((reduce + gather) / 4)
    fsdp = dataclasses.replace(FP8_DP, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim")  # not DDP's
    assert gradient_sync(params, fsdp, HW, buckets=4, buffer=BF16_BESIDE_FP8, first_rank=True, **long) == \
        pytest.approx(later)
    plain = dataclasses.replace(FP8_DP, fp8_format=None, fp8_param_gather=False)  # one BF16 buffer: no merge
    assert gradient_sync(params, plain, HW, buckets=4, buffer=BF16_BESIDE_FP8, first_rank=True, **long) == \
        pytest.approx((reduce + net.gather(2e9, 8, 8)) / 4)


@pytest.mark.parametrize("bucket_size, groups", [(64, 40), (None, 20), (10**9, 1)])
def test_align_param_gather_outside_the_interleaved_schedule_shows_every_bucket_groups_gather(bucket_size, groups):
    """With ``align_param_gather`` only the interleaved schedule launches the gathers ahead; otherwise each FP8
    bucket group's gather is launched by its own pre-hook and waited on: all of it shows, a collective a group
    (a tiny bucket: one FP8 weight each; megatron-core's default: 40M parameters, 8e8 / 40M = 20 groups)."""
    params, net, long = ParamCount(dense=10**9), Collectives(HW), dict(forward_s=10.0, backward_s=10.0)
    aligned = dataclasses.replace(FP8_DP, align_param_gather=True, ddp_bucket_size=bucket_size)
    reduce, gathered = net.gather(4e9, 8, 8), 0.8e9 + 2 * 0.2e9
    shown = gradient_sync(params, aligned, HW, buckets=4, buffer=BF16_BESIDE_FP8, first_rank=True, **long)
    assert shown == pytest.approx(0.2 * reduce + 0.8 * reduce / 4 + groups * net.gather(gathered / groups, 8, 8))
    interleaved = dataclasses.replace(aligned, virtual_pipeline_model_parallel_size=2)
    assert gradient_sync(params, interleaved, HW, buckets=4, buffer=BF16_BESIDE_FP8, first_rank=True, **long) == \
        gradient_sync(params, FP8_DP, HW, buckets=4, buffer=BF16_BESIDE_FP8, first_rank=True, **long)


@pytest.mark.parametrize("recipe, gathered", [("delayed", 1e9), ("tensorwise", 1e9), ("mxfp8", 2e9)])
def test_fp8_weights_are_gathered_as_megatron_core_buffers_them(recipe, gathered):
    """``fp8_param_gather``: a tensor-scaled FP8 weight's bucket is uint8 (one byte a weight gathered); MXFP8
    weights are gathered in BF16 and cast as they are copied out (two)."""
    params, net = ParamCount(dense=10**9), Collectives(HW)
    dp = dataclasses.replace(TRAINING, data_parallel_size=8, global_batch_size=32, overlap_grad_reduce=False,
                             fp8_format="e4m3", fp8_recipe=recipe, fp8_param_gather=True)
    assert gradient_sync(params, dp, HW) == pytest.approx(net.gather(4e9, 8, 8) + net.gather(gathered, 8, 8))


@pytest.mark.parametrize("experts,ep,dispatcher,permutations", [
    (16, 8, "alltoall", 2), (8, 8, "alltoall", 1), (16, 8, "flex", 1), (16, 1, "alltoall", 1)])
def test_the_all_to_all_dispatcher_sorts_received_copies_by_local_expert(experts, ep, dispatcher, permutations):
    """megatron-core's all-to-all dispatcher permutes the copies a rank receives a second time when it holds
    more than one expert (and unpermutes them before the combine): twice the permutation traffic."""
    moe = dataclasses.replace(MODEL, num_experts=experts, moe_router_topk=2)
    training = dataclasses.replace(TRAINING, expert_model_parallel_size=ep, data_parallel_size=8, global_batch_size=64,
                                   moe_token_dispatcher_type=dispatcher)
    work = WorkModel(moe, training)
    assert work.permutations == permutations
    copies_bytes = work.expert_copies * moe.hidden_size * work.e
    once = dataclasses.replace(training, moe_token_dispatcher_type="flex")
    extra = work.layer("moe").forward.memory_bytes - WorkModel(moe, once).layer("moe").forward.memory_bytes
    assert extra == pytest.approx(4 * copies_bytes * (permutations - 1))


def test_sharded_gradients_are_reduce_scattered_every_microbatch_beside_the_compute():
    """Megatron-FSDP optim_grads: each microbatch's gradients are reduce-scattered (no whole buffer kept);
    compute hides them but for the last bucket, what outlasts it shows for every microbatch."""
    params = ParamCount(dense=10**9)
    dp = dataclasses.replace(TRAINING, data_parallel_size=8, global_batch_size=32, use_megatron_fsdp=True,
                             data_parallel_sharding_strategy="optim_grads")
    net = Collectives(HW)
    reduce, gather = net.gather(4e9, 8, 8), net.gather(2e9, 8, 8)
    assert dp.shards_gradients and dp.microbatches == 2
    assert gradient_sync(params, dp, HW, buckets=4, forward_s=4.0, backward_s=6.0) == pytest.approx(gather + reduce / 4)
    short = reduce / 2
    assert gradient_sync(params, dp, HW, buckets=4, forward_s=short / 4, backward_s=3 * short / 4) == pytest.approx(
        gather + 2 * (reduce - short))
    unhidden = dataclasses.replace(dp, overlap_grad_reduce=False)
    assert gradient_sync(params, unhidden, HW, backward_s=10.0) == pytest.approx(gather + 2 * reduce)


def test_per_head_query_key_norms_read_and_write_queries_and_keys():
    normed = dataclasses.replace(MODEL, qk_layernorm=True)
    extra = WorkModel(normed, TRAINING).layer("dense").forward.memory_bytes - \
        WorkModel(MODEL, TRAINING).layer("dense").forward.memory_bytes
    assert extra == pytest.approx(2 * (2 * 2048) * (8 + 8) * 128 * 2)  # tokens x (a + g) heads x d, read and write


def test_bf16_gradient_reduction_moves_half_the_bytes():
    params = ParamCount(dense=10**9)
    dp = dataclasses.replace(TRAINING, data_parallel_size=8, global_batch_size=32, overlap_grad_reduce=False,
                             grad_reduce_in_bf16=True)
    net = Collectives(HW)
    assert gradient_sync(params, dp, HW) == pytest.approx(net.gather(2e9, 8, 8) + net.gather(2e9, 8, 8))


def test_sharded_weights_are_gathered_before_every_forward_and_backward_beside_the_compute():
    """Megatron-FSDP optim_grads_params: each microbatch gathers the weights twice (forward, backward); what
    outlasts the compute shows per microbatch, and no gather is left for the step's end."""
    params = ParamCount(dense=10**9)
    zero3 = dataclasses.replace(TRAINING, data_parallel_size=8, global_batch_size=32, use_megatron_fsdp=True,
                                data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=True)
    net = Collectives(HW)
    reduce, gather = net.gather(4e9, 8, 8), net.gather(2e9, 8, 8)
    assert gradient_sync(params, zero3, HW, buckets=4, backward_s=10.0) == pytest.approx(reduce / 4)
    short = gather
    assert gradient_sync(params, zero3, HW, buckets=4, forward_s=short) == pytest.approx(
        2 * (2 * gather - short) + 2 * (reduce - short))


def test_fsdp2_copies_gathered_weights_and_packs_gradients_on_the_compute_stream():
    """PyTorch FSDP2 (``fsdp_implementation: torch``): each microbatch copies a layer's gathered bf16 weights out
    of the all-gather buffer in F and, resharded after the forward, again in B (read and write 2 bytes each),
    and packs its bf16 gradients into the fp32 reduce buffer in W (2 + 4); the root (embedding, output layer)
    once in F, the output layer's gradients in W. One byte each way under a float8 all-gather. Nothing under
    FSDP1, Megatron-FSDP, or PyTorch's pipelining keeping the stage gathered for the step."""
    torch_fsdp = dataclasses.replace(TRAINING, pipeline_model_parallel_size=1, data_parallel_size=8,
                                     global_batch_size=32, use_megatron_fsdp=True, fsdp_implementation="torch",
                                     data_parallel_sharding_strategy="optim_grads_params")
    fsdp1 = dataclasses.replace(torch_fsdp, torch_fsdp_version="fsdp1")
    layer_params = 4 * 1024 * 1024 + 2 * 1024 * 4096 + 2 * 1024  # attention, MLP, two norms
    vocab_params = 32000 * 1024

    def extra(training: TrainingSpec, part: str) -> list[float]:
        work, base = WorkModel(MODEL, training), WorkModel(MODEL, fsdp1)
        return [a.memory_bytes - b.memory_bytes for a, b in zip(work.part(part).passes(), base.part(part).passes())]

    assert extra(torch_fsdp, "dense") == pytest.approx([4 * layer_params, 4 * layer_params, 6 * layer_params])
    kept = dataclasses.replace(torch_fsdp, fsdp_reshard_after_forward=False)
    assert extra(kept, "dense") == pytest.approx([4 * layer_params, 0, 6 * layer_params])
    fp8 = dataclasses.replace(torch_fsdp, fp8_format="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True)
    fp8_work, fp8_base = WorkModel(MODEL, fp8), WorkModel(MODEL, dataclasses.replace(fp8, torch_fsdp_version="fsdp1"))
    assert fp8_work.layer("dense").forward.memory_bytes - fp8_base.layer("dense").forward.memory_bytes == \
        pytest.approx(2 * layer_params)
    assert extra(torch_fsdp, "embedding") == pytest.approx([4 * vocab_params, 0, 0])
    assert extra(torch_fsdp, "head") == pytest.approx([4 * (vocab_params + 1024), 0, 6 * (vocab_params + 1024)])
    stage_kept = dataclasses.replace(kept, pipeline_model_parallel_size=2, data_parallel_size=4)
    assert extra(stage_kept, "dense") == [0, 0, 0]
    megatron = dataclasses.replace(torch_fsdp, fsdp_implementation="megatron")
    assert not megatron.fsdp2_copies and not fsdp1.fsdp2_copies and torch_fsdp.fsdp2_copies
    with pytest.raises(InputError, match="torch_fsdp_version"):
        spec_from_mapping(TrainingSpec, {"torch_fsdp_version": "fsdp1"}, "test")


def test_context_parallel_ring_merges_each_step_in_fp32():
    """Ring attention adds, per CP step, a read of the step's output and a read and write of the fp32
    accumulator forward; the same for dQ and dK/dV backward. Nothing without CP."""
    gqa = dataclasses.replace(MODEL, num_query_groups=2)
    plain = WorkModel(gqa, TRAINING).layer("dense")
    ring = WorkModel(gqa, dataclasses.replace(TRAINING, context_parallel_size=2)).layer("dense")
    half = dataclasses.replace(TRAINING, micro_batch_size=1)  # the same tokens per rank without CP
    base = WorkModel(gqa, half).layer("dense")
    tokens, d = 2048, 128
    out, dq, dkv = tokens * 8 * d, tokens * 8 * d, tokens * 2 * 2 * d
    assert ring.forward.memory_bytes - base.forward.memory_bytes == pytest.approx(2 * out * (2 + 8))
    assert ring.backward_input.memory_bytes - base.backward_input.memory_bytes == pytest.approx(2 * (dq + dkv) * (2 + 8))
    assert plain.forward.memory_bytes == pytest.approx(2 * base.forward.memory_bytes)


def test_first_and_last_layers_in_bf16_run_slower_than_the_fp8_ones_where_they_sit():
    """first_last_layers_bf16: the first and last layer keep BF16 GEMMs; the stages holding them get the BF16
    layer's time, the others the FP8 layer's."""
    hw = dataclasses.replace(HW, peak_fp8_tflops=200.0)
    fp8 = dataclasses.replace(TRAINING, pipeline_model_parallel_size=4, fp8_format="hybrid")
    ends = dataclasses.replace(fp8, first_last_layers_bf16=True)
    assert ends.bf16_layers(4) == {0, 3} and fp8.bf16_layers(4) == frozenset()
    parts = part_times(WorkModel(MODEL, ends), hw, Calibration())
    assert parts["dense:bf16"].forward > parts["dense"].forward
    assert parts["dense:bf16"].forward == pytest.approx(part_times(WorkModel(MODEL, TRAINING), hw, Calibration())["dense"].forward)
    placement = Placement.interleaved(4)
    mixed, allfp8 = stage_costs(MODEL, ends, hw, parts, placement), stage_costs(MODEL, fp8, hw, parts, placement)
    assert mixed.forward[1:3] == allfp8.forward[1:3]
    assert mixed.forward[0] > allfp8.forward[0] and mixed.forward[3] > allfp8.forward[3]


def test_attention_rate_follows_the_sequence_length_one_kernel_sees():
    """attention_length_rates: log-scale interpolation between pairs, the nearest pair outside them; a
    context-parallel rank's kernels see s / CP queries."""
    rated = dataclasses.replace(HW, attention_length_rates=((1024, 0.5), (4096, 1.0)))
    assert rated.attention_rate(2048) == pytest.approx(0.75)
    assert (rated.attention_rate(256), rated.attention_rate(65536), rated.attention_rate(None)) == (0.5, 1.0, 1.0)
    assert HW.attention_rate(512) == 1.0
    plain = part_times(WorkModel(MODEL, TRAINING), HW, Calibration())["dense"]
    slow = part_times(WorkModel(MODEL, TRAINING), rated, Calibration())["dense"]  # 2048 queries: 0.75 of the rate
    assert slow.attention[0] == pytest.approx(plain.attention[0] / 0.75)
    ring = dataclasses.replace(TRAINING, context_parallel_size=2)  # 1024 queries per ring step: 0.5
    assert part_times(WorkModel(MODEL, ring), rated, Calibration())["dense"].attention[1] == pytest.approx(
        part_times(WorkModel(MODEL, ring), HW, Calibration())["dense"].attention[1] / 0.5)


def test_the_backward_takes_its_own_length_rates_where_the_file_gives_them():
    """attention_backward_length_rates price the B pass's attention kernels (a selective recompute's forward stays at
    the forward's rates); a file without them runs the backward at the forward's rates, as before."""
    forward_only = dataclasses.replace(HW, attention_length_rates=((1024, 0.5), (4096, 1.0)))
    both = dataclasses.replace(forward_only, attention_backward_length_rates=((1024, 0.25), (4096, 0.8)))
    assert both.attention_rate(2048) == forward_only.attention_rate(2048, backward=True) == pytest.approx(0.75)
    assert both.attention_rate(2048, backward=True) == pytest.approx(0.525)
    recompute = dataclasses.replace(TRAINING, recompute_granularity="selective", recompute_modules=("core_attn",))
    old, new = (part_times(WorkModel(MODEL, recompute), h, Calibration())["dense"] for h in (forward_only, both))
    assert new.attention[0] == pytest.approx(old.attention[0]) and new.attention[2] == old.attention[2] == 0
    assert new.attention[1] == pytest.approx(old.attention[1] * 0.75 / 0.525)
    assert new.backward_input - old.backward_input == pytest.approx(new.attention[1] - old.attention[1])
    assert new.recompute == pytest.approx(old.recompute) and new.recompute > 0
    assert new.forward == pytest.approx(old.forward)


@pytest.mark.parametrize("field", ["attention_length_rates", "attention_backward_length_rates",
                                   "attention_head_dim_rates", "attention_backward_head_dim_rates"])
@pytest.mark.parametrize("rates", [[[0, 1.0]], [[1024, 0.0]], [[1024]], [[1024, 2.0]]])
def test_a_bad_attention_rate_table_is_refused(rates, field):
    values = {"peak_bf16_tflops": 100, "hbm_bytes": 1e9, "hbm_bandwidth_bytes_per_s": 1e12,
              "intra_node_bandwidth_bytes_per_s": 1e11, "inter_node_bandwidth_bytes_per_s": 1e10, field: rates}
    with pytest.raises(InputError, match=field):
        spec_from_mapping(HardwareSpec, values, "hw.yaml")


@pytest.mark.parametrize("forward_s,backward_s", [(0.0, 0.0), (0.01, 0.03), (0.2, 0.5), (1.0, 3.0), (50.0, 90.0)])
@pytest.mark.parametrize("edp_across_nodes", [False, True])
def test_overlapped_data_parallel_sync_shows_what_outlasts_one_microbatch(forward_s, backward_s, edp_across_nodes):
    """Megatron reduces the accumulated gradients during the last microbatch's backward only and gathers the
    weights ahead of the first microbatch's forward only: of each, the last (first) bucket shows, or what
    outlasts that one microbatch's compute -- never less, however many microbatches the step has."""
    params = ParamCount(dense=10**8, expert=4 * 10**9)
    ep = 8 if edp_across_nodes else 1
    t = dataclasses.replace(TRAINING, data_parallel_size=64, global_batch_size=64 * 8, expert_model_parallel_size=ep,
                            overlap_param_gather=True, pipeline_model_parallel_size=1)
    net, span = Collectives(HW), 64
    reduce = net.gather(1e8 * 4, 64, span) + net.gather(4e9 * 4, t.expert_data_parallel_size, span)
    gather = net.gather(1e8 * 2, 64, span) + net.gather(4e9 * 2, t.expert_data_parallel_size, span)
    expected = max(reduce / 8, reduce - backward_s) + max(gather / 8, gather - forward_s)
    got = gradient_sync(params, t, HW, buckets=8, forward_s=forward_s, backward_s=backward_s)
    assert got == pytest.approx(expected)
    assert gradient_sync(params, t, HW, buckets=8, forward_s=forward_s * 2, backward_s=backward_s * 2) <= got
    assert got >= (reduce + gather) / 8


@pytest.mark.parametrize("microbatches", [1, 5, 40])
def test_experts_replicated_over_nodes_expose_their_synchronisation(microbatches):
    """GPT-OSS 120B on 64 B200 as Megatron-Bridge ran it (MBS 4): at EP 8 each rank's 16 experts of every layer
    are replicated over 8 nodes and their gradients and weights cross one network card per step, more than
    one microbatch's compute hides; at EP 64 every expert lives once and nothing of that kind is left. The
    step's exposed synchronisation does not depend on how many microbatches there are."""
    model = load_model(EXAMPLES / "models" / "gpt-oss-120b.yaml")
    projector = Projector(model, load_hardware(EXAMPLES / "hardware" / "b200.yaml"))
    base = TrainingSpec(micro_batch_size=4, global_batch_size=4 * 64 * microbatches, pipeline_model_parallel_size=1,
                        data_parallel_size=64, expert_tensor_parallel_size=1, overlap_param_gather=True,
                        grad_reduce_in_bf16=True, moe_router_force_load_balancing=True)
    sync = {ep: projector.evaluate(dataclasses.replace(base, expert_model_parallel_size=ep), "1f1b").gradient_sync_s
            for ep in (8, 64)}
    expert_bytes = 16 * model.num_layers * 3 * model.hidden_size * model.expert_ffn * 2  # bf16, biases aside
    one_way = Collectives(projector.hardware).gather(expert_bytes, 8, 64)
    assert one_way > 0.5  # one network card: the strided expert-data-parallel group
    assert sync[8] > 0.5 * one_way and sync[64] < 0.1 * sync[8]


@pytest.mark.parametrize("dispatcher,router_dtype,precision,r", [
    ("alltoall", None, "bf16", 2), ("alltoall", "fp32", "bf16", 4), ("flex", None, "bf16", 4),
    ("flex", "fp32", "bf16", 4), ("alltoall", "fp64", "bf16", 8), ("alltoall", None, "fp32", 4)])
@pytest.mark.parametrize("experts,ep", [(16, 8), (16, 2), (8, 8)])
def test_expert_biases_are_applied_outside_the_grouped_gemm_per_local_expert(dispatcher, router_dtype, precision, r,
                                                                               experts, ep):
    """megatron-core's TEGroupedMLP adds the experts' second bias after the grouped GEMM (_apply_bias): bias x
    routing probability plus each local expert's output slice, concatenated and cast back -- element-wise passes
    over the copies x H output in the promoted dtype of the activations and the probabilities (fp32 on the flex
    dispatcher, the router's dtype otherwise), and 4 + 2 per local expert ops and kernels each pass."""
    biased = dataclasses.replace(MODEL, num_experts=experts, moe_router_topk=2, add_bias_linear=True)
    plain = dataclasses.replace(biased, add_bias_linear=False)
    t = dataclasses.replace(TRAINING, expert_model_parallel_size=ep, data_parallel_size=8, global_batch_size=64,
                            moe_token_dispatcher_type=dispatcher, moe_router_dtype=router_dtype, precision=precision)
    work, e = WorkModel(biased, t), t.activation_bytes
    assert max(work.probs_bytes, e) == r
    elements = work.expert_copies * biased.hidden_size
    cast = (r + e) if r != e else 0
    with_bias, without = work.layer("moe"), WorkModel(plain, t).layer("moe")
    assert with_bias.forward.memory_bytes - without.forward.memory_bytes == pytest.approx((5 * r + e + cast) * elements)
    assert with_bias.backward_input.memory_bytes - without.backward_input.memory_bytes == pytest.approx(
        (6 * r + 2 * cast) * elements)
    assert with_bias.backward_weight.memory_bytes == without.backward_weight.memory_bytes
    ops = 4 + 2 * experts // ep
    f, b, w = moe_small_kernels(biased, t)
    f0, b0, w0 = moe_small_kernels(plain, t)
    assert (f - f0, b - b0, w - w0) == (ops, ops, 0)


def _clamp_bytes_of_megatron(fused_rows: int, half: int) -> tuple[float, float]:
    """Bytes megatron-core's own ``weighted_bias_quick_geglu_impl`` moves with ``clamp_value`` 7.0 beyond what it
    moves without, forward and backward, per element of one half of its bf16 input: every aten operation it
    dispatches (CPU mode; torch.compile off, so the fused body runs eagerly and cancels between the two runs)
    counted as the bytes of its tensor inputs and outputs, views aside. In a forked process (megatron's CPU mode
    patches torch globally)."""
    import torch

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    import torch._dynamo

    torch._dynamo.config.disable = True
    from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl

    Moved = byte_counter()

    def moved(clamp):
        x = torch.randn(fused_rows, 2 * half, dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(fused_rows, 1, requires_grad=True)
        forward, backward = Moved(), Moved()
        with forward:
            y = weighted_bias_quick_geglu_impl(x, None, probs, False, 1.0, clamp)
        grad = torch.randn_like(y)
        with backward:
            y.backward(grad)
        return forward.bytes, backward.bytes

    (f, b), (f0, b0) = moved(7.0), moved(None)
    return (f - f0) / (fused_rows * half), (b - b0) / (fused_rows * half)


def test_the_experts_clamp_costs_what_megatron_core_dispatches_for_it():
    """GPT-OSS's clamped GLU: megatron-core clamps the two halves of the first expert linear's output with eager ops
    and concatenates them before its fused activation, forward, again in a moe_act recompute, and autograd's
    clamp gradients and the halves' concatenation backward. The work model's bytes per element match the aten
    operations megatron-core's own function dispatches."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        forward, backward = pool.apply(_clamp_bytes_of_megatron, (96, 40))
    model = dataclasses.replace(MODEL, num_experts=16, moe_router_topk=4, swiglu=True, activation_func_clamp_value=7.0)
    t = dataclasses.replace(TRAINING, expert_model_parallel_size=2, data_parallel_size=2, global_batch_size=16)
    work = WorkModel(model, t)
    elements = work.expert_copies * model.expert_ffn
    clamp = work._expert_clamp()
    assert clamp.forward.memory_bytes / elements == pytest.approx(forward)  # 8 bytes an element in bf16
    assert clamp.backward_input.memory_bytes / elements == pytest.approx(backward, abs=0.01)  # 30 (two scalars aside)
    assert clamp.backward_weight.memory_bytes == 0


@pytest.mark.parametrize("recompute", [(), ("moe_act",), ("moe",), ("layernorm", "moe_act")])
@pytest.mark.parametrize("fusion", [True, False])
def test_a_clamped_glu_adds_its_passes_to_the_moe_layer_and_its_recompute(recompute, fusion):
    """The clamp's bytes land in the MoE layer's F and B (not W, not dense layers), its forward again in B under a
    recompute of moe_act or moe; without the fused activation there is no concatenation forward. Without moe_act
    recompute the clamped copy of fc1's output is kept beside fc1's output."""
    from primuspipe.projection.activations import ActivationModel

    plain = dataclasses.replace(MODEL, num_experts=16, moe_router_topk=4, swiglu=True, moe_layer_freq=(0, 1, 1, 1))
    clamped = dataclasses.replace(plain, activation_func_clamp_value=7.0)
    t = dataclasses.replace(TRAINING, expert_model_parallel_size=2, data_parallel_size=2, global_batch_size=16,
                            bias_activation_fusion=fusion, recompute_granularity="selective" if recompute else None,
                            recompute_modules=recompute)
    ours, base = WorkModel(clamped, t), WorkModel(plain, t)
    e, elements = t.activation_bytes, ours.expert_copies * plain.expert_ffn
    forward = (8 if fusion else 4) * e * elements
    moe, moe0 = ours.layer("moe"), base.layer("moe")
    assert moe.forward.memory_bytes - moe0.forward.memory_bytes == pytest.approx(forward)
    assert moe.backward_input.memory_bytes - moe0.backward_input.memory_bytes == pytest.approx((11 * e + 8) * elements)
    assert moe.backward_weight.memory_bytes == moe0.backward_weight.memory_bytes
    repeated = moe.recompute.memory_bytes - moe0.recompute.memory_bytes
    assert repeated == pytest.approx(forward if {"moe_act", "moe"} & set(recompute) else 0.0)
    assert ours.layer("dense") == base.layer("dense")
    kept = ActivationModel(clamped, t).layer("moe").total - ActivationModel(plain, t).layer("moe").total
    assert kept == pytest.approx(0.0 if {"moe_act", "moe"} & set(recompute) else 2 * e * elements)


def _rope_bytes_of_megatron(tokens: int, heads: int, head_dim: int) -> tuple[float, float, float, float]:
    """Bytes megatron-core's own unfused ``_apply_rotary_pos_emb_bshd`` moves forward and backward per element of its
    bf16 input (every aten operation it dispatches, views aside, in CPU mode), and the concentration factors its
    ``_yarn_get_concentration_factor`` gives GPT-OSS's YaRN (factor 32) and a factor 40 with mscale 1 over 0.5."""
    import torch

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor

    Moved = byte_counter()

    t = torch.randn(tokens, 1, heads, head_dim, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.randn(tokens, 1, 1, head_dim, dtype=torch.float32)  # megatron-core builds it in fp32
    forward, backward = Moved(), Moved()
    with forward:
        y = _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, mscale=1.3466)
    grad = torch.randn_like(y)
    with backward:
        y.backward(grad)
    per = t.numel() * t.element_size()
    return (forward.bytes / per, backward.bytes / per, _yarn_get_concentration_factor(32.0, None, None),
            _yarn_get_concentration_factor(40.0, 1.0, 0.5))


def test_unfused_rope_costs_what_megatron_core_dispatches_and_yarn_forces_it():
    """megatron-core's apply_rotary_pos_emb hands a YaRN rotary embedding (a concentration factor other than 1) to its
    unfused chain of eager ops even under apply_rope_fusion; the work model's bytes per rotated element, fused and
    unfused, and its concentration factor match megatron-core's own functions."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        forward, backward, gpt_oss, ratio = pool.apply(_rope_bytes_of_megatron, (128, 64, 64))
    yarn = dataclasses.replace(MODEL, position_embedding_type="yarn", yarn_rotary_scaling_factor=32.0)
    assert yarn.rope_concentration == pytest.approx(gpt_oss)
    assert dataclasses.replace(yarn, yarn_rotary_scaling_factor=40.0, yarn_mscale=1.0,
                               yarn_mscale_all_dim=0.5).rope_concentration == pytest.approx(ratio)
    assert dataclasses.replace(yarn, yarn_rotary_scaling_factor=1.0).rope_concentration == 1.0
    elements = TRAINING.micro_batch_size * MODEL.seq_length * 2 * MODEL.num_attention_heads * MODEL.head_dim
    unfused = WorkModel(yarn, TRAINING)
    assert not unfused.rope_fused and WorkModel(MODEL, TRAINING).rope_fused
    rope = unfused._unfused_rope()
    # beside the 12 bytes of e per element: the fp32 frequency table's cos, sin, their scaling and casts (44 bytes
    # per table entry) and the bf16 tables read by the two products (2 + 2), one entry per token and channel
    table = (44 + 4) / 2 / 64
    assert rope.forward.memory_bytes / elements / 2 + table == pytest.approx(forward)
    assert rope.backward_input.memory_bytes / elements / 2 == pytest.approx(backward, rel=0.01)
    assert WorkModel(MODEL, TRAINING)._unfused_rope() == PassWork(Work(), Work(), Work())  # the fused kernel's
    assert WorkModel(MODEL, TRAINING)._elementwise_kernels("dense")["rope"] == 2 * elements * 2  # a read and a write
    assert "rope" not in WorkModel(yarn, TRAINING)._elementwise_kernels("dense")
    asked_off = dataclasses.replace(TRAINING, apply_rope_fusion=False)
    assert WorkModel(MODEL, asked_off)._unfused_rope() == rope


def test_yarn_rotary_positions_move_time_only_through_the_unfused_rope():
    """A YaRN model differs from its RoPE twin by the unfused rotary embedding's extra bytes forward and backward, and
    by the cos and sin tables the unfused path keeps; its parameters are the same."""
    from primuspipe.projection.activations import ActivationModel
    from primuspipe.projection.parameters import embedding_params

    yarn = dataclasses.replace(MODEL, position_embedding_type="yarn", yarn_rotary_scaling_factor=32.0)
    ours, base = WorkModel(yarn, TRAINING).layer("dense"), WorkModel(MODEL, TRAINING).layer("dense")
    elements = TRAINING.micro_batch_size * MODEL.seq_length * 2 * MODEL.num_attention_heads * MODEL.head_dim
    e = TRAINING.activation_bytes
    # unfused 12 and 14 bytes of e an element against the fused kernel's 2 and 2 (its inverse rotation backward)
    assert ours.forward.memory_bytes - base.forward.memory_bytes == pytest.approx(10 * e * elements)
    assert ours.backward_input.memory_bytes - base.backward_input.memory_bytes == pytest.approx(12 * e * elements)
    assert ours.backward_weight == base.backward_weight and ours.forward.gemms == base.forward.gemms
    tables = 4 * MODEL.seq_length * MODEL.head_dim * e  # cos and sin, for queries and for keys
    assert ActivationModel(yarn, TRAINING).layer("dense").total - ActivationModel(MODEL, TRAINING).layer("dense").total \
        == pytest.approx(tables)
    assert embedding_params(yarn, 1) == embedding_params(MODEL, 1)


@pytest.mark.parametrize("fields", [{"yarn_rotary_scaling_factor": 32.0}, {"yarn_mscale": 1.0}])
def test_yarn_settings_without_a_yarn_embedding_are_refused(fields):
    with pytest.raises(InputError, match="position_embedding_type"):
        dataclasses.replace(MODEL, **fields)


@pytest.mark.parametrize("value", [0.0, -7.0, float("inf")])
def test_a_clamp_that_bounds_nothing_is_refused(value):
    with pytest.raises(InputError, match="activation_func_clamp_value"):
        dataclasses.replace(MODEL, activation_func_clamp_value=value)


@pytest.mark.parametrize("experts,ep", [(16, 2), (16, 8)])
def test_automodel_deepep_experts_add_both_biases_in_a_loop_and_compile_the_clamp(experts, ep):
    """NeMo AutoModel's GroupedExpertsDeepEP: ops.gmm takes no bias, so the first bias is added like the second,
    per local expert and concatenated (4e an element of the copies x 2F output forward, e backward, 2 + E/EP ops
    each pass); its clamped GLU is one compiled function, so the clamps add no pass and no kept copy. The second
    bias costs what megatron-core's _apply_bias does."""
    from primuspipe.projection.activations import ActivationModel

    biased = dataclasses.replace(MODEL, num_experts=experts, moe_router_topk=4, swiglu=True, add_bias_linear=True,
                                 activation_func_clamp_value=7.0)
    megatron = dataclasses.replace(TRAINING, expert_model_parallel_size=ep, data_parallel_size=8, global_batch_size=64,
                                   moe_token_dispatcher_type="flex")
    automodel = dataclasses.replace(megatron, expert_kernels="automodel-deepep")
    ours, theirs, e = WorkModel(biased, automodel), WorkModel(biased, megatron), megatron.activation_bytes
    assert ours._expert_clamp() == PassWork(Work(), Work(), Work())
    assert theirs._expert_input_bias() == PassWork(Work(), Work(), Work())
    assert ours._expert_output_bias() == theirs._expert_output_bias()
    wide = ours.expert_copies * 2 * biased.expert_ffn
    clamp = theirs._expert_clamp()
    moe, moe0 = ours.layer("moe"), theirs.layer("moe")
    assert moe.forward.memory_bytes - moe0.forward.memory_bytes == pytest.approx(
        4 * e * wide - clamp.forward.memory_bytes)
    assert moe.backward_input.memory_bytes - moe0.backward_input.memory_bytes == pytest.approx(
        e * wide - clamp.backward_input.memory_bytes)
    assert moe.backward_weight == moe0.backward_weight
    ops = 2 + experts // ep
    assert [a - b for a, b in zip(moe_small_kernels(biased, automodel), moe_small_kernels(biased, megatron))] == [
        ops, ops, 0]
    kept = ActivationModel(biased, megatron).layer("moe").total - ActivationModel(biased, automodel).layer("moe").total
    assert kept == pytest.approx(2 * e * ours.expert_copies * biased.expert_ffn)  # megatron's clamped copy


def test_automodel_deepep_experts_need_the_flex_dispatcher():
    with pytest.raises(InputError, match="expert_kernels"):
        dataclasses.replace(TRAINING, expert_kernels="automodel-deepep")


def _visited_key_blocks(seq: int, left: int, block: int) -> int:
    """Key blocks a flash kernel must visit for a causal window of ``left`` keys, by brute force over the queries:
    block j serves query block i when some query q of i sees a key of j, i.e. j * block <= q and
    (j + 1) * block - 1 >= q - left."""
    blocks = -(-seq // block)
    return sum(any(j * block <= q and (j + 1) * block - 1 >= q - left
                   for q in range(i * block, min(seq, (i + 1) * block)))
               for i in range(blocks) for j in range(i + 1))


@pytest.mark.parametrize("seq,left,every", [(4096, 128, 2), (4096, 128, None), (2048, 100, 3), (1024, 129, 2),
                                            (4096, 4096, 2), (512, 0, None), (4096, 1000, 4)])
def test_sliding_window_layers_visit_only_the_key_blocks_their_window_reaches(seq, left, every):
    """megatron-core windows layer n (from 1) unless n % window_attn_skip_freq == 0; a windowed layer's flash kernel
    visits, per query block, the key blocks its window reaches -- counted here by brute force over the mask -- and
    the full layers the causal triangle. MFU's causal convention counts what the kernels do; the full convention
    (NVIDIA's) counts the whole square in every layer, windowed or not."""
    from primuspipe.projection.compute.attention import ATTENTION_BLOCK

    plain = dataclasses.replace(MODEL, seq_length=seq, num_layers=12)
    model = dataclasses.replace(plain, window_size=(left, 0), window_attn_skip_freq=every)
    windowed = sum(1 for n in range(1, 13) if every is None or n % every)
    assert model.windowed_layers == windowed
    blocks = -(-seq // ATTENTION_BLOCK)
    share = _visited_key_blocks(seq, left, ATTENTION_BLOCK) / (blocks * (blocks + 1) / 2)
    expected = (windowed * share + 12 - windowed) / 12
    t = dataclasses.replace(TRAINING, pipeline_model_parallel_size=1, global_batch_size=2)
    ours, full = WorkModel(model, t), WorkModel(plain, t)
    assert ours.window_share == pytest.approx(expected)
    for a, b in zip(ours.layer("dense").passes(), full.layer("dense").passes()):
        assert a.attention_flops == pytest.approx(b.attention_flops * expected)
    unfused = dataclasses.replace(t, attention_backend="unfused")  # computes the whole square, then masks
    assert WorkModel(model, unfused).layer("dense").forward.attention_flops == \
        WorkModel(plain, unfused).layer("dense").forward.attention_flops
    assert ours.model_flops("full") == pytest.approx(full.model_flops("full"))
    assert ours.model_flops("causal") <= full.model_flops("causal")


@pytest.mark.parametrize("window,every,field", [((128, 1), None, "window_size"), ((128,), None, "window_size"),
                                               (None, 2, "window_attn_skip_freq"), ((128, 0), 0, "window_attn_skip_freq")])
def test_window_settings_are_checked(window, every, field):
    with pytest.raises(InputError, match=field):
        dataclasses.replace(MODEL, window_size=window, window_attn_skip_freq=every)


@pytest.mark.parametrize("head_dim,rate", [(64, 0.63), (128, 1.0), (32, 0.63), (256, 1.0), (96, 0.63 + 0.37 * 0.585)])
def test_attention_runs_slower_with_narrow_heads(head_dim, rate):
    """attention_head_dim_rates scales the fused kernels' rate by the head dimension, on a log scale between the
    pairs and held outside them; without the table every width runs at one rate."""
    hw = dataclasses.replace(HW, attention_head_dim_rates=((64, 0.63), (128, 1.0)))
    assert hw.attention_rate(None, head_dim) == pytest.approx(rate, abs=2e-3)
    assert HW.attention_rate(None, head_dim) == 1.0
    model = dataclasses.replace(MODEL, kv_channels=head_dim)
    base = part_times(WorkModel(model, TRAINING), HW, Calibration())["dense"].attention
    narrow = part_times(WorkModel(model, TRAINING), hw, Calibration())["dense"].attention
    assert narrow[0] == pytest.approx(base[0] / rate, rel=5e-3) and narrow[1] == pytest.approx(base[1] / rate, rel=5e-3)


def test_the_backward_takes_its_own_head_dim_rates_where_the_file_gives_them():
    """attention_backward_head_dim_rates price the B pass's kernels at narrow heads (a selective recompute's forward
    and the F pass stay at attention_head_dim_rates); without them both passes take attention_head_dim_rates."""
    model = dataclasses.replace(MODEL, kv_channels=64)
    forward_only = dataclasses.replace(HW, attention_head_dim_rates=((64, 0.5), (128, 1.0)))
    both = dataclasses.replace(forward_only, attention_backward_head_dim_rates=((64, 0.8), (128, 1.0)))
    assert forward_only.attention_rate(None, 64, backward=True) == 0.5
    assert both.attention_rate(None, 64) == 0.5 and both.attention_rate(None, 64, backward=True) == 0.8
    assert both.attention_rate(None, 128, backward=True) == 1.0
    recompute = dataclasses.replace(TRAINING, recompute_granularity="selective", recompute_modules=("core_attn",))
    old, new = (part_times(WorkModel(model, recompute), h, Calibration())["dense"] for h in (forward_only, both))
    assert new.attention[0] == pytest.approx(old.attention[0]) and new.attention[1] == pytest.approx(
        old.attention[1] * 0.5 / 0.8)
    assert new.recompute == pytest.approx(old.recompute) and new.recompute > 0


@pytest.mark.parametrize("recipe,align", [("mxfp8", 32), ("tensorwise", 16), ("delayed", 16), ("blockwise", 16)])
@pytest.mark.parametrize("dispatcher,backend,router_padding", [
    ("alltoall", "deepep", False), ("allgather", "deepep", False), ("flex", "deepep", False),
    ("flex", "hybridep", False), ("alltoall", "deepep", True)])
@pytest.mark.parametrize("capacity_factor,pad", [(None, False), (1.0, True), (1.03125, True), (1.01, True), (1.0, False)])
def test_fp8_experts_pad_unaligned_token_counts_with_two_copies_each_way(recipe, align, dispatcher, backend,
                                                                         router_padding, capacity_factor, pad):
    """megatron-core's TEGroupedMLP pads each expert's copies to the FP8 alignment (Fp8Padding) and unpads the
    output (Fp8Unpadding) under FP8; Transformer Engine copies only when some count is unaligned. Counts arrive
    aligned when the router pads the routing map, when HybridEP pads in its dispatch, or when every expert computes
    a capacity (ceil(T_r k / E * factor), Megatron's get_capacity) that is a multiple of the alignment."""
    moe = dataclasses.replace(MODEL, num_experts=16, moe_router_topk=2)
    t = dataclasses.replace(TRAINING, expert_model_parallel_size=8, data_parallel_size=8, global_batch_size=64,
                            moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend=backend,
                            moe_router_padding_for_quantization=router_padding, moe_expert_capacity_factor=capacity_factor,
                            moe_pad_expert_input_to_capacity=pad, fp8_format="e4m3", fp8_recipe=recipe)
    assert t.fp8_alignment == align
    capacity = -(-(2 * 2048 * 2 * (capacity_factor or 1)) // 16)  # T_r k / E, rounded up
    arrives_aligned = router_padding or (dispatcher, backend) == ("flex", "hybridep") or (pad and capacity % align == 0)
    work = WorkModel(moe, t)
    assert work.fp8_padding_copies == (not arrives_aligned)
    plain = WorkModel(moe, dataclasses.replace(t, moe_router_padding_for_quantization=True)).layer("moe")
    layer = work.layer("moe")
    copies = work.expert_copies * t.load_imbalance
    moved = 0 if arrives_aligned else 4 * copies * moe.hidden_size * work.e + 2 * copies * work.probs_bytes
    assert layer.forward.memory_bytes - plain.forward.memory_bytes == pytest.approx(moved)
    assert layer.backward_input.memory_bytes - plain.backward_input.memory_bytes == pytest.approx(moved)
    assert layer.backward_weight.memory_bytes == plain.backward_weight.memory_bytes
    kernels = [a - b for a, b in zip(moe_small_kernels(moe, t), moe_small_kernels(
        moe, dataclasses.replace(t, moe_router_padding_for_quantization=True)))]
    assert kernels == ([0, 0, 0] if arrives_aligned else [3, 3, 0])  # pad copies and probabilities, unpad the output
    bf16 = t.without_fp8()
    assert not WorkModel(moe, bf16).fp8_padding_copies
    assert WorkModel(moe, bf16).layer("moe").forward.memory_bytes == WorkModel(
        moe, dataclasses.replace(bf16, moe_router_padding_for_quantization=True)).layer("moe").forward.memory_bytes


@pytest.mark.parametrize("stage,fp8", [(0, True), (1, True), (1, False), (2, True)])
def test_primus_sync_free_moe_pads_the_routing_map_under_fp8(stage, fp8):
    """Primus's sync-free MoE sets moe_router_padding_for_quantization under FP8 at every stage
    (rocm_arg_validation.py, _get_sync_free_moe_options), so its experts get aligned counts."""
    t = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=8, data_parallel_size=8,
                     global_batch_size=64, enable_primus_turbo=True, turbo_sync_free_moe_stage=stage,
                     moe_router_dtype="fp32", fp8_format="e4m3" if fp8 else None, use_turbo_grouped_gemm=stage > 1)
    assert t.moe_router_padding_for_quantization == (stage > 0 and fp8)
    assert WorkModel(dataclasses.replace(MODEL, num_experts=16, moe_router_topk=2), t).fp8_padding_copies == (
        fp8 and stage == 0)


def _squared_relu_bytes(rows: int, width: int) -> tuple[float, float]:
    """Bytes an eager squared ReLU, ``torch.pow(F.relu(x), 2)`` (NeMo 2's ``squared_relu``,
    ``nemo/collections/llm/fn/activation.py`` at v2.2.0, its ``@torch.jit.script`` commented out), moves forward
    and backward per element of its bf16 input: every aten operation it and autograd dispatch, views aside."""
    import torch

    Moved = byte_counter()
    x = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    forward, backward = Moved(), Moved()
    with forward:
        y = torch.pow(torch.nn.functional.relu(x), 2)
    grad = torch.randn_like(y)
    with backward:
        y.backward(grad)
    return forward.bytes / x.numel(), backward.bytes / x.numel()


def test_an_eager_squared_relu_costs_what_its_aten_operations_move():
    """NeMo 2 runs Nemotron's squared ReLU eager (relu, then pow; backward pow's gradient as three element-wise
    products and relu's threshold_backward): 4 bytes of the activations' dtype an element forward and 10 backward,
    where a compiled one (megatron-core's ``@jit_fuser`` squared_relu, the default) moves what GELU's fused kernel
    does, 2 and 3. Only the dense MLP's activation changes, in F and B."""
    forward, backward = _squared_relu_bytes(64, 96)
    relu2 = dataclasses.replace(MODEL, squared_relu=True)
    eager = dataclasses.replace(TRAINING, squared_relu_fusion=False)
    e, elements = TRAINING.activation_bytes, 2 * 2048 * MODEL.ffn  # one microbatch's tokens x the MLP width
    gelu, compiled, unfused = (WorkModel(m, t).layer("dense") for m, t in
                               ((MODEL, TRAINING), (relu2, TRAINING), (relu2, eager)))
    assert compiled == gelu
    assert unfused.forward.memory_bytes - gelu.forward.memory_bytes == pytest.approx((4 - 2) * e * elements)
    assert unfused.backward_input.memory_bytes - gelu.backward_input.memory_bytes == pytest.approx((10 - 3) * e * elements)
    assert unfused.backward_weight == gelu.backward_weight
    assert 4 * e == pytest.approx(forward, rel=0.01) and 10 * e == pytest.approx(backward, rel=0.01)
    assert WorkModel(MODEL, eager).layer("dense") == gelu  # the switch touches squared-ReLU models only


def test_squared_relu_and_swiglu_exclude_each_other():
    with pytest.raises(InputError, match="one activation"):
        dataclasses.replace(MODEL, squared_relu=True, swiglu=True)


def test_the_nemotron_models_run_squared_relu_eager_on_nemo_2_rows_only():
    """The Nemotron model files are squared-ReLU models; the published rows that ran NeMo 2 (NeMo 25.02's and
    25.04's performance scripts and dgxc-benchmarking on 25.02 and, on GB200, 25.04) run its eager activation, the
    NeMo 24.07 rows (NeMo 1's compiled one) do not."""
    from published_rows import shipped_runs

    for name in ("nemotron3-8b", "nemotron3-22b", "nemotron4-15b", "nemotron4-340b"):
        assert load_model(EXAMPLES / "models" / f"{name}.yaml").squared_relu
    eager = {r.id for r in shipped_runs() if r.model.startswith("nemotron") and r.training.get("squared_relu_fusion") is False}
    nemotron = {r.id for r in shipped_runs() if r.model.startswith("nemotron")}
    assert eager == {i for i in nemotron if i.startswith(("dgxc2504-", "dgxc2505-gb200-", "nemo2502-", "nemo2504-gb200-"))}
