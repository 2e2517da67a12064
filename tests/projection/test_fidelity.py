"""What makes projected times follow real runs: GEMMs by shape (waves, roofline, FP8, grouped GEMMs), the
communication the frameworks hide, DeepEP's per-node dedup, explicit pipeline layouts and MTP, MFU both
ways, zb-auto never behind the fixed tables, and the published-runs table the bench compares with."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest

from published_rows import shipped_runs
from primuspipe.projection.comm import Collectives, LayerComm, destination_ranks, layer_comm, linear_shares
from primuspipe.projection.compute import Calibration, WorkModel, model_flops_per_token, part_times
from primuspipe.projection.gemm import GROUPED_GEMM_KERNELS, Gemm, gemm_seconds, grouped_waves
from primuspipe.projection.hardware_spec import HardwareSpec, load_hardware
from primuspipe.projection.layout import StageLayout, layer_counts, parse_layout
from primuspipe.projection.framework import Placement
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.parameters import ParamCount, embedding_params, head_params, layer_params
from primuspipe.projection.projection import Projector, ProjectionResult, project
from primuspipe.projection.published import load_runs, model_of, project_run, training_of
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import RankShape, TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
HW = HardwareSpec(name="t", peak_bf16_tflops=100.0, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=1e12,
                  memory_bandwidth_fraction=1.0, intra_node_bandwidth_bytes_per_s=100e9,
                  inter_node_bandwidth_bytes_per_s=10e9, network_efficiency=1.0, gpus_per_node=8, gemm_efficiency=0.5,
                  compute_units=4, gemm_tile=(128, 128), peak_fp8_tflops=200.0, fp8_gemm_efficiency=0.25)
UNIT = 2 * 128 * 128 / (100e12 * 0.5)  # seconds of one tile per unit of k at the bf16 rate


def test_gemms_run_in_waves_of_tiles_and_never_beat_the_roofline():
    k = 4096
    assert gemm_seconds(Gemm(4 * 128, 128, k), HW, "bf16") == pytest.approx(4 * UNIT * k)  # 4 tiles: one full wave
    assert gemm_seconds(Gemm(5 * 128, 128, k), HW, "bf16") == pytest.approx(2 * 4 * UNIT * k)  # a 5th tile: 2 waves
    assert gemm_seconds(Gemm(4 * 100, 128, k), HW, "bf16") == pytest.approx(4 * UNIT * k)  # partial tiles pay in full
    skinny, slow_memory = Gemm(1, 8192, 8192), dataclasses.replace(HW, hbm_bandwidth_bytes_per_s=1e9)
    assert gemm_seconds(skinny, slow_memory, "bf16") == pytest.approx((8192 * 8192 + 8192 + 8192) * 2 / 1e9)  # reads B
    # run one after another (SequentialMLP), a grouped GEMM's groups each have their own last wave
    assert gemm_seconds(Gemm(128, 128, k, groups=3, kernel="sequential"), HW, "bf16") == pytest.approx(3 * 4 * UNIT * k)
    # FP8 at the FP8 peak and its own efficiency (here 200 * 0.25 = the bf16 rate)
    assert gemm_seconds(Gemm(4 * 128, 128, k, fp8=True), HW, "bf16") == pytest.approx(4 * UNIT * k)
    flat = dataclasses.replace(HW, gemm_efficiency=None, achievable_fraction=0.5)  # old hardware files: shape-free
    assert gemm_seconds(Gemm(5 * 128, 128, k), flat, "bf16") == pytest.approx(2 * 5 * 128 * 128 * k / 50e12)


@pytest.mark.parametrize("kernel, streams, waves", [
    ("fused", 4, 1),         # one kernel: the 6 groups' 6 tiles fill the 6 units once
    ("multi_stream", 4, 2),  # Transformer Engine's 4 streams: a round of 4 tiles (one wave), then 2 (another)
    ("multi_stream", 2, 3),  # ROCm with 2 hardware queues: 3 rounds of 2 concurrent groups
    ("multi_stream", 1, 6),  # one queue: as sequential
    ("sequential", 4, 6),    # SequentialMLP: a wave per group whatever the streams
])
def test_a_grouped_gemms_groups_share_waves_as_its_kernel_path_runs_them(kernel, streams, waves):
    six_units, k = dataclasses.replace(HW, compute_units=6), 4096
    gemm = Gemm(128, 128, k, groups=6, kernel=kernel, streams=streams)  # one tile a group
    assert gemm_seconds(gemm, six_units, "bf16") == pytest.approx(waves * 6 * UNIT * k)
    # the gradients (and a scaled pass) run on the same path
    assert {(g.kernel, g.streams) for g in (gemm.dgrad(), gemm.wgrad(), gemm.times(2))} == {(kernel, streams)}


@pytest.mark.parametrize("seed", range(5))
def test_grouped_waves_order_the_paths_and_agree_for_one_group(seed):
    import random
    rng = random.Random(seed)
    for _ in range(200):
        tiles, units, groups = rng.randint(1, 600), rng.randint(1, 304), rng.randint(1, 40)
        fused = grouped_waves(tiles, units, groups, "fused")
        multi = [grouped_waves(tiles, units, groups, "multi_stream", s) for s in (4, 2, 1)]
        sequential = grouped_waves(tiles, units, groups, "sequential")
        assert math.ceil(tiles * groups / units) == fused <= multi[0] <= multi[1] <= multi[2] == sequential
        assert sequential == groups * math.ceil(tiles / units)
        assert len({grouped_waves(tiles, units, 1, p) for p in GROUPED_GEMM_KERNELS}) == 1


def test_the_experts_gemms_follow_the_trainings_kernel_path_and_hardware_queues():
    model = load_model(EXAMPLES / "models" / "deepseek-v2-lite.yaml")
    mi355x = load_hardware(EXAMPLES / "hardware" / "mi355x.yaml")
    base = dict(micro_batch_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                expert_model_parallel_size=8, data_parallel_size=8)

    def experts(**settings):
        work = WorkModel(model, TrainingSpec(**base, **settings)).layer("moe")
        grouped = [g for w in work.passes() for g in w.gemms if g.groups > 1]
        assert len(grouped) == 6  # two expert linears, three passes each
        return grouped, sum(gemm_seconds(g, mi355x, "bf16") for g in grouped)

    default, multi = experts()
    assert {(g.kernel, g.streams) for g in default} == {("multi_stream", 4)}
    queues, two = experts(gpu_max_hw_queues=2)
    assert {(g.kernel, g.streams) for g in queues} == {("multi_stream", 2)}
    _, fused = experts(moe_expert_gemm="fused")
    _, sequential = experts(moe_expert_gemm="sequential")
    assert fused <= multi <= two < sequential
    turbo, turbo_s = experts(moe_expert_gemm="sequential", enable_primus_turbo=True, use_turbo_grouped_gemm=True)
    assert {g.kernel for g in turbo} == {"fused"} and turbo_s == fused  # Primus-Turbo's one grouped kernel
    with pytest.raises(InputError, match="gpu_max_hw_queues"):
        TrainingSpec(gpu_max_hw_queues=0)


def test_fp8_needs_an_fp8_peak_and_mixed_precision():
    no_fp8 = dataclasses.replace(HW, peak_fp8_tflops=None)
    with pytest.raises(InputError, match="peak_fp8_tflops"):
        gemm_seconds(Gemm(128, 128, 128, fp8=True), no_fp8, "bf16")
    with pytest.raises(InputError, match="FP8 GEMMs need mixed precision"):
        TrainingSpec(fp8_format="hybrid", precision="fp32")
    with pytest.raises(InputError, match="without FP8"):
        TrainingSpec(fp8_recipe="blockwise")
    from primuspipe.projection.compute import Calibration, part_times
    model = load_model(EXAMPLES / "models" / "llama2-7b.yaml")
    with pytest.raises(InputError, match="MXFP8 needs matrix units"):
        part_times(WorkModel(model, TrainingSpec(fp8_format="e4m3", fp8_recipe="mxfp8")), HW, Calibration())


def test_fp8_runs_its_linear_layers_in_fp8_and_keeps_fp8_copies():
    model = load_model(EXAMPLES / "models" / "llama2-7b.yaml")
    bf16, fp8 = TrainingSpec(), TrainingSpec(fp8_format="hybrid")
    layer = WorkModel(model, fp8).layer("dense")
    assert all(g.fp8 for g in layer.forward.gemms) and layer.forward.memory_bytes > WorkModel(model, bf16).layer("dense").forward.memory_bytes
    assert not any(g.fp8 for g in WorkModel(model, fp8).head().forward.gemms)  # the output layer stays bf16
    from primuspipe.projection.activations import ActivationModel
    assert ActivationModel(model, fp8).layer("dense").total < ActivationModel(model, bf16).layer("dense").total


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fp8_operands_are_quantized_where_transformer_engine_quantizes_them(recipe, tp):
    model = load_model(EXAMPLES / "models" / "llama3-8b.yaml")
    fp8 = TrainingSpec(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, fp8_format="hybrid", fp8_recipe=recipe,
                       pipeline_model_parallel_size=1, global_batch_size=1)
    bf16 = fp8.without_fp8()
    work, plain = WorkModel(model, fp8), WorkModel(model, bf16)
    n = 1.0
    per_tensor, current, sp = recipe != "blockwise", recipe == "tensorwise", tp > 1
    # bytes per element: a plain cast-transpose 4 (+2 for current scaling's amax pass); a norm's output is quantized
    # by the norm kernel; under sequence parallelism a gathered operand is cast on its 1/TP shard, transposed whole
    norm_fed = ((3 if current else -1) / tp + 2 if sp else (4 if current else 1)) if per_tensor else 4
    gathered_grad = ((5 if current else 3) / tp + 2 if sp else (6 if current else 4)) if per_tensor else 4
    assert work._quantize_bytes(n, norm_fed=True, gathered=sp) == pytest.approx(norm_fed)
    assert work._quantize_bytes(n, gathered=sp) == pytest.approx(gathered_grad)
    assert work._quantize_bytes(n) == pytest.approx((6 if current else 4) if per_tensor else 4)
    # a dense layer's forward adds exactly its four input quantizations to the bf16 layer's element-wise bytes
    t, h, ffn = work.tokens, model.hidden_size, model.ffn / tp
    casts = (2 * t * h * norm_fed + t * (model.num_attention_heads * model.head_dim / tp + ffn)
             * ((6 if current else 4) if per_tensor else 4))
    forward = work.layer("dense").forward
    moved = forward.memory_bytes + forward.fp8_transpose_bytes
    assert moved - plain.layer("dense").forward.memory_bytes == pytest.approx(casts)
    # of which the transposed copies: written by the cast (1), or read and written after it (2) for a gathered
    # operand and a delayed-scaling norm's FP8 output; a GPU whose FP8 GEMMs take any layout (Blackwell) skips them
    transposed = (2 * t * h * (2 if sp or not current else 1)
                  + t * (model.num_attention_heads * model.head_dim / tp + ffn)) if per_tensor else 0.0
    assert forward.fp8_transpose_bytes == pytest.approx(transposed)
    any_layout = dataclasses.replace(HW, fp8_gemm_any_layout=True)
    assert forward.seconds(HW, "bf16") - forward.seconds(any_layout, "bf16") == pytest.approx(transposed / 1e12)
    # the gathers of those operands move one byte per element; current scaling all-reduces each amax first, unhidden
    net, activation = Collectives(HW), t * h * 2
    saved = 2 * (net.gather(activation, tp, tp) - net.gather(activation / 2, tp, tp)) if sp and per_tensor else 0.0
    comm, comm_bf16 = layer_comm(model, fp8, HW, "dense"), layer_comm(model, bf16, HW, "dense")
    assert comm_bf16.tp[0] - comm.tp[0] == pytest.approx(saved)
    amax = 2 * net.all_reduce(4, tp, tp) if sp and current else 0.0
    assert comm.blocking == pytest.approx((amax, amax, 0.0))
    overlapped = dataclasses.replace(fp8, tp_comm_overlap=True)
    assert comm.exposed(overlapped, (1.0,) * 3, (0.0,) * 3, (1.0,) * 3)[0] >= amax


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("model_name", ["llama3-8b", "qwen3-30b-a3b"])
def test_mxfp8_casts_write_both_copies_with_their_scales_at_the_cast_kernels_bandwidth(model_name, tp):
    model = load_model(EXAMPLES / "models" / f"{model_name}.yaml")
    ep = 8 if model.num_experts else 1
    mx = TrainingSpec(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
                      fp8_format="e4m3", fp8_recipe="mxfp8", pipeline_model_parallel_size=1, global_batch_size=8,
                      data_parallel_size=8)
    work, plain = WorkModel(model, mx), WorkModel(model, mx.without_fp8())
    # bf16 read (2), row-wise and column-wise FP8 written (1 + 1), an E8M0 scale per 32 elements for each: the same
    # for a norm's output (TE runs MXFP8 norms unfused) and for a gathered operand (counted as cast whole)
    for kw in ({}, {"norm_fed": True}, {"gathered": tp > 1}):
        assert work._quantize_bytes(1.0, **kw) == pytest.approx(4 + 2 / 32)
    kind = "moe" if model.num_experts else "dense"
    layer, bf16 = work.layer(kind), plain.layer(kind)
    # the casts are MXFP8 bytes, not element-wise bytes: they add nothing to memory_bytes (the MoE layer's only
    # element-wise FP8 work is the experts' padding copies, test_time_model's)
    padding = work._fp8_padding()
    assert (kind == "moe") == (padding.forward.memory_bytes > 0)  # dropless on the all-to-all dispatcher: copied
    assert layer.forward.memory_bytes - padding.forward.memory_bytes == pytest.approx(bf16.forward.memory_bytes)
    assert layer.backward_input.memory_bytes - padding.backward_input.memory_bytes == pytest.approx(
        bf16.backward_input.memory_bytes)
    # one cast per FP8 GEMM operand fed from bf16: every FP8 linear's input forward, its output gradient backward
    fwd = sum(g.m * g.k * g.groups for g in layer.forward.gemms if g.fp8)
    bwd = sum(g.m * g.k * g.groups for g in layer.backward_input.gemms if g.fp8)
    assert layer.forward.mxfp8_cast_bytes == pytest.approx(fwd * (4 + 2 / 32))
    assert layer.backward_input.mxfp8_cast_bytes == pytest.approx(bwd * (4 + 2 / 32))
    assert layer.backward_weight.mxfp8_cast_bytes == 0.0
    # timed at mxfp8_cast_bandwidth_fraction where the hardware file gives it, else at the element-wise fraction
    slow = dataclasses.replace(HW, mxfp8_cast_bandwidth_fraction=0.5, block_scaled_fp8=True)
    fast = dataclasses.replace(HW, block_scaled_fp8=True)
    extra = layer.forward.seconds(slow, "bf16") - layer.forward.seconds(fast, "bf16")
    assert extra == pytest.approx(layer.forward.mxfp8_cast_bytes / 1e12)  # (1/0.5 - 1/1.0) x bytes / bandwidth
    assert fast.mxfp8_cast_fraction == fast.memory_bandwidth_fraction and slow.mxfp8_cast_fraction == 0.5
    with pytest.raises(InputError, match="mxfp8_cast_bandwidth_fraction"):
        dataclasses.replace(HW, mxfp8_cast_bandwidth_fraction=1.5)
    # its linears' GEMMs are block-scaled in every pass, and run at mxfp8_gemm_efficiency where the file gives it
    passes = [g for w in layer.passes() for g in w.gemms]
    assert all(g.mxfp8 == g.fp8 for g in passes) and any(g.mxfp8 for g in passes)
    assert not any(g.mxfp8 for w in WorkModel(model, dataclasses.replace(mx, fp8_recipe="tensorwise")).layer(kind).passes()
                   for g in w.gemms)
    big = Gemm(4 * 128, 128, 4096, fp8=True, mxfp8=True)
    assert gemm_seconds(big, dataclasses.replace(fast, mxfp8_gemm_efficiency=0.125), "bf16") == pytest.approx(
        2 * gemm_seconds(big, fast, "bf16"))  # half the FP8 efficiency (0.25) -> twice the time
    assert gemm_seconds(big.dgrad(), fast, "bf16") == gemm_seconds(dataclasses.replace(big.dgrad(), mxfp8=False), fast, "bf16")
    assert big.dgrad().mxfp8 and big.wgrad().mxfp8 and big.times(2).mxfp8


def test_overlapped_communication_shows_only_what_outlasts_its_compute():
    comm = LayerComm(tp=(4.0, 4.0, 1.0), cp=(2.0, 4.0, 0.0), ep=(3.0, 3.0, 0.0))
    plain = TrainingSpec(tensor_model_parallel_size=4, context_parallel_size=2, sequence_parallel=True)
    gemm, attention, compute = (3.0, 3.0, 3.0), (1.0, 2.5, 0.0), (5.0, 2.0, 3.0)
    # TP not overlapped; CP's ring hides all but the first step (1 of 2) or what outlasts attention; EP exposed
    assert comm.exposed(plain, gemm, attention, compute) == pytest.approx((4 + 1 + 3, 4 + 2 + 3, 1))
    overlapped = dataclasses.replace(plain, tp_comm_overlap=True, overlap_moe_expert_parallel_comm=True)
    assert comm.exposed(overlapped, gemm, attention, compute) == pytest.approx((1 + 1 + 0, 1 + 2 + 1, 0))
    # a reduce-scatter's last step follows the GEMM's last chunk: it shows even under a long GEMM
    tailed = dataclasses.replace(comm, tp_tail=(1.5, 0.0, 0.0))
    assert tailed.exposed(overlapped, gemm, attention, compute)[0] == pytest.approx(1.5 + 1 + 0)


def test_torch_async_tp_hides_each_collective_under_its_own_matmuls_only():
    """PyTorch's async TP fuses a gather into the matmuls that consume it and a reduce-scatter into the one matmul
    that produces it: B's input-gradient reduce-scatters (of a sum of GEMM outputs) run unfused and show whole,
    and each fused reduce-scatter's partial sum shows in F (torch's micro_pipeline_tp pass, _symmetric_memory)."""
    model = load_model(EXAMPLES / "models" / "llama3-8b.yaml")
    te = TrainingSpec(tensor_model_parallel_size=8, sequence_parallel=True, tp_comm_overlap=True,
                      pipeline_model_parallel_size=1, global_batch_size=8, data_parallel_size=1, micro_batch_size=8)
    torch_tp = dataclasses.replace(te, tp_comm_overlap_impl="torch-async-tp")
    net = Collectives(HW)
    comm, plain = layer_comm(model, torch_tp, HW, "dense"), layer_comm(model, te, HW, "dense")
    assert plain.partial_sums == 0.0 and comm.tp == plain.tp
    assert all(c.gemm_share for c in plain.fused)  # TE overlaps every one (test_userbuffers_...)
    shape = RankShape(model, torch_tp)
    gather = net.gather(shape.tokens * model.hidden_size * shape.e, 8, 8)
    assert sum(c.seconds for c in comm.fused if c.pass_index == 0) == pytest.approx(comm.tp[0])
    assert sum(c.seconds for c in comm.fused if c.pass_index == 1) == pytest.approx(comm.tp[1])
    assert sum(not c.gemm_share for c in comm.fused) == 2 and all(c.pass_index == 1 for c in comm.fused if not c.gemm_share)
    f_shares = sum(c.gemm_share for c in comm.fused if c.pass_index == 0)
    assert f_shares == pytest.approx(1.0)  # every F linear is fused with one collective
    # long GEMMs: TE hides all of F but the tails, and B whole; torch leaves B's two reduce-scatters and F's sums
    long = (1e3, 1e3, 1e3)
    te_f, te_b, _ = plain.exposed(te, long, (0.0,) * 3, long)
    f, b, w = comm.exposed(torch_tp, long, (0.0,) * 3, long)
    assert te_b == 0.0 and b == pytest.approx(2 * gather)
    assert f == pytest.approx(te_f + comm.partial_sums) and comm.partial_sums > 0
    # no GEMM time: everything shows, the sums on top in F
    none = (0.0,) * 3
    assert comm.exposed(torch_tp, none, none, none)[:2] == pytest.approx((comm.tp[0] + comm.partial_sums, comm.tp[1]))
    # its fused matmuls run as TP matmuls of m / TP rows one after another: the forward GEMMs of the four linears
    # and the input-gradient GEMMs of the projection and the second linear; the rest whole
    split, whole = WorkModel(model, torch_tp).layer("dense"), WorkModel(model, te).layer("dense")
    assert [g.groups for g in split.forward.gemms] == [8, 8, 8, 8] and split.forward.gemm_flops == whole.forward.gemm_flops
    assert [g.groups for g in split.backward_input.gemms] == [1, 8, 1, 8]
    assert all(g.groups == 1 for g in split.backward_weight.gemms)
    assert all(g.kernel == "sequential" and g.m == 8 * 8192 / 8 for g in split.forward.gemms)
    h100 = load_hardware(EXAMPLES / "hardware" / "h100.yaml")  # smaller tiles by the shape curve and waves
    assert split.forward.gemm_seconds(h100, "bf16") > whole.forward.gemm_seconds(h100, "bf16")
    with pytest.raises(InputError, match="sequence parallelism"):
        dataclasses.replace(torch_tp, sequence_parallel=False)
    with pytest.raises(InputError, match="dense layers"):
        layer_comm(load_model(EXAMPLES / "models" / "qwen3-30b-a3b.yaml"),
                   dataclasses.replace(torch_tp, expert_model_parallel_size=8, data_parallel_size=8, global_batch_size=64),
                   HW, "moe")


def test_userbuffers_hide_each_collective_under_the_gemm_of_its_own_call():
    """Transformer Engine's userbuffers overlap one collective with one GEMM per call, and the next kernel waits for
    both (comm_gemm_overlap.cpp), so in a dense layer a collective longer than its own GEMM shows even where the
    pass's other GEMMs are long; B's reduce-scatters run beside W's GEMMs and W's re-gathers beside B's (bulk)."""
    model = load_model(EXAMPLES / "models" / "llama3-8b.yaml")
    te = TrainingSpec(tensor_model_parallel_size=8, sequence_parallel=True, tp_comm_overlap=True,
                      pipeline_model_parallel_size=1, global_batch_size=8, data_parallel_size=1, micro_batch_size=8)
    comm = layer_comm(model, te, HW, "dense")
    for i in range(3):  # the collectives are the pass's, one by one
        assert sum(c.seconds for c in comm.fused if c.pass_index == i) == pytest.approx(comm.tp[i])
    assert all(c.gemm_share for c in comm.fused)  # every one runs beside a GEMM
    assert {(c.pass_index, c.under) for c in comm.fused if c.under is not None} == {(1, 2), (2, 1)}
    share = linear_shares(model, 8)  # each GEMM hosts one collective: F's four, B's four, W's QKV and first linear
    hosted = [sum(c.gemm_share for c in comm.fused if (c.pass_index if c.under is None else c.under) == i)
              for i in range(3)]
    assert hosted == pytest.approx([1.0, 1.0, share["qkv"] + share["fc1"]])
    gather = comm.fused[1].seconds  # a reduce-scatter
    # long GEMMs: all hidden but F's two reduce-scatter tails, as under the pooled rule
    long = (1e3, 1e3, 1e3)
    assert comm.exposed(te, long, (0.0,) * 3, long) == pytest.approx((2 * gather / 8 + comm.blocking[0], 0.0, 0.0))
    # GEMMs as long as the pass's collectives: pooled, they would hide all but the tails; tied to their own GEMMs
    # the collectives longer than their GEMM's share show
    even = comm.tp
    f, b, w = comm.exposed(te, even, (0.0,) * 3, even)
    pooled = LayerComm(tp=comm.tp, tp_tail=comm.tp_tail, blocking=comm.blocking)
    pf, pb, pw = pooled.exposed(te, even, (0.0,) * 3, even)
    assert (pf, pb, pw) == pytest.approx((comm.tp_tail[0] + comm.blocking[0], 0.0, 0.0))
    by_hand = [sum(max(c.seconds / 8 if c.scatter else 0.0,
                       c.seconds - c.gemm_share * even[c.pass_index if c.under is None else c.under])
                   for c in comm.fused if c.pass_index == i) for i in range(3)]
    assert (f - comm.blocking[0], b - comm.blocking[1], w) == pytest.approx(by_hand)
    assert f > pf and b + w > pb + pw
    # MoE and MLA layers, and TP without sequence parallelism, keep the pooled rule
    qwen = load_model(EXAMPLES / "models" / "qwen3-30b-a3b.yaml")
    moe = dataclasses.replace(te, expert_model_parallel_size=8, data_parallel_size=8, global_batch_size=64)
    assert layer_comm(qwen, moe, HW, "moe").fused == ()
    assert layer_comm(model, dataclasses.replace(te, sequence_parallel=False), HW, "dense").fused == ()


def test_all_to_all_across_nodes_and_deepep_dedup():
    net = Collectives(HW)
    assert net.all_to_all(8e9, 8, 8) == pytest.approx(net.gather(8e9, 8, 8))  # one node: the fabric
    # 16 ranks on 2 nodes: 7/16 of the buffer over the fabric, 8/16 over the network, at once
    assert net.all_to_all(16e9, 16, 16) == pytest.approx(max(7e9 / 100e9, 8e9 / 10e9) + 15 * HW.inter_node_latency_s)
    model = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                      num_experts=64, moe_router_topk=8)
    ep = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=32, data_parallel_size=32,
                      global_batch_size=32)
    flex = dataclasses.replace(ep, moe_token_dispatcher_type="flex")
    # a token's 8 distinct experts of 64, 16 a node, miss a node with probability C(48, 8) / C(64, 8): sent once to
    # each of the nodes they touch
    nodes, k = 4, 8
    dedup = nodes * (1 - math.comb(48, k) / math.comb(64, k)) / k
    a2a, deepep = layer_comm(model, ep, HW, "moe").ep[0], layer_comm(model, flex, HW, "moe").ep[0]
    latency = 2 * 31 * HW.inter_node_latency_s
    assert deepep - latency == pytest.approx((a2a - latency) * dedup)


@pytest.mark.parametrize("experts,k,ep", [(8, 2, 2), (8, 3, 4), (12, 4, 3), (16, 4, 8), (10, 3, 5), (16, 6, 4),
                                           (128, 8, 8), (128, 8, 32), (64, 6, 16)])
def test_flex_dispatch_sends_a_token_once_to_each_rank_holding_its_experts(experts, k, ep):
    """Inside a node DeepEP / HybridEP send a token to each EP rank holding one of its experts once; the rank
    count is checked against the routes themselves: every k-subset of experts (a router's pick, forced balance's
    random logits included), and AutoModel's fake gate rebuilt as its source builds it (arange(T k) % E)."""
    model = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                      num_experts=experts, moe_router_topk=k)
    routed = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=ep, data_parallel_size=ep,
                          global_batch_size=ep, moe_token_dispatcher_type="flex")
    fake = dataclasses.replace(routed, fake_balanced_gate=True)
    per_rank = experts // ep

    def ranks(route) -> int:
        return len({e // per_rank for e in route})

    if math.comb(experts, k) <= 200_000:
        picks = list(itertools.combinations(range(experts), k))
        assert destination_ranks(model, routed) == pytest.approx(sum(map(ranks, picks)) / len(picks))
    else:  # the same law by inclusion: a rank is missed when all k experts fall on the others
        assert destination_ranks(model, routed) == pytest.approx(ep * (1 - math.comb(experts - per_rank, k)
                                                                     / math.comb(experts, k)))
    tokens = 1000
    routes = [[(t * k + j) % experts for j in range(k)] for t in range(tokens)]  # FakeBalancedGate's indices
    assert destination_ranks(model, fake) == pytest.approx(sum(map(ranks, routes)) / tokens, rel=experts / tokens)
    # the all-to-all carries one copy per destination rank, not per expert
    node = dataclasses.replace(HW, gpus_per_node=max(8, ep))  # the group inside one node
    plain = dataclasses.replace(routed, moe_token_dispatcher_type="alltoall")
    a2a, flex = layer_comm(model, plain, node, "moe").ep[0], layer_comm(model, routed, node, "moe").ep[0]
    latency = 2 * (ep - 1) * HW.intra_node_latency_s
    assert flex - latency == pytest.approx((a2a - latency) * destination_ranks(model, routed) / k)


def test_the_fake_balanced_gate_has_no_router_gemm():
    model = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                      num_experts=16, moe_router_topk=2)
    routed = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=2, data_parallel_size=2,
                          global_batch_size=2)
    fake = WorkModel(model, dataclasses.replace(routed, fake_balanced_gate=True)).layer("moe")
    real = WorkModel(model, routed).layer("moe")
    router = 2 * 1024 * 1024 * 16  # T x H x E, forward
    assert real.forward.gemm_flops - fake.forward.gemm_flops == pytest.approx(router)
    assert real.forward.memory_bytes - fake.forward.memory_bytes == pytest.approx(1024 * 16 * 12)  # fp32 logits
    assert dataclasses.replace(routed, fake_balanced_gate=True).load_imbalance == 1.0


def test_explicit_layouts_and_the_embedding_and_loss_accounting():
    assert parse_layout("Et|(tt|)*3mL") == ["Et", "tt", "tt", "tt", "mL"]
    # commas are cosmetic, as megatron-core reads them (its own example: "Ettt|(tt|)*29,m|L")
    assert parse_layout("Ettt|(tt|)*29,m|L") == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert parse_layout("E, t|t * 2, L") == parse_layout("Et|ttL")
    assert layer_counts(126, pp=16, vpp=8, embedding_slot=True, loss_slot=True)[:2] == (0, 1)
    mtp = TrainingSpec(pipeline_model_parallel_size=5, pipeline_model_parallel_layout="Et|(tt|)*3mL", mtp_num_layers=1)
    layout = StageLayout.build(7, mtp, Placement.interleaved(5))
    assert layout.counts == (1, 2, 2, 2, 0)
    with pytest.raises(InputError, match="1 MTP layer"):  # m without mtp_num_layers was priced as no MTP
        StageLayout.build(7, dataclasses.replace(mtp, mtp_num_layers=None), Placement.interleaved(5))
    with pytest.raises(InputError, match="places 6 transformer layers"):
        StageLayout.build(7, TrainingSpec(pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Et|tt|tt|tL"),
                          Placement.interleaved(4))


def test_mtp_adds_a_layer_and_a_head_to_the_last_stage():
    model = load_model(EXAMPLES / "models" / "deepseek-v2-lite.yaml")
    hw = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    base = TrainingSpec(pipeline_model_parallel_size=3, global_batch_size=8)
    plain, mtp = (Projector(model, hw).evaluate(t, "1f1b") for t in (base, dataclasses.replace(base, mtp_num_layers=1)))
    assert mtp.step_time_s > plain.step_time_s and mtp.peak_memory_bytes[-1] > plain.peak_memory_bytes[-1]
    assert mtp.peak_memory_bytes[0] == plain.peak_memory_bytes[0]


def test_mtp_all_reduces_the_embeddings_gradients_between_the_first_and_last_stage():
    """An untied model with multi-token prediction keeps a copy of the embedding table on the MTP stage, and
    megatron-core all-reduces its gradients with the first stage's after the backward, as for a tied output layer
    (``finalize_model_grads._allreduce_word_embedding_grads``: ``share_embeddings_and_output_weights or ...
    mtp_num_layers``): one data-parallel replica syncs nothing else."""
    model = load_model(EXAMPLES / "models" / "deepseek-v2-lite.yaml")
    hw = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    base = TrainingSpec(pipeline_model_parallel_size=3, global_batch_size=8)
    assert model.untie_embeddings_and_output_weights and base.dp == 1
    plain, mtp = (Projector(model, hw).evaluate(t, "1f1b") for t in (base, dataclasses.replace(base, mtp_num_layers=1)))
    table = embedding_params(model, 1) * base.main_grad_bytes
    assert plain.gradient_sync_s == 0 and mtp.gradient_sync_s == pytest.approx(Collectives(hw).all_reduce(table, 2, 3))

def test_mfu_both_ways_and_zb_auto_never_behind_a_fixed_table():
    model = load_model(EXAMPLES / "models" / "llama2-7b.yaml")
    hw = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    results, _ = project(Projector(model, hw), TrainingSpec(global_batch_size=16, data_parallel_size=2,
                                                            tensor_model_parallel_size=4, sequence_parallel=True))
    for r in results:
        assert 0 < r.mfu < r.mfu_full_attention <= 1 and math.isfinite(r.step_time_s)
    auto = next(r for r in results if r.algorithm == "zb-auto")
    fitting = [r for r in results if r.algorithm != "zb-auto" and r.verdict != "OOM"]
    assert auto.step_time_s <= min(r.step_time_s for r in fitting) + 1e-9
    assert model_flops_per_token(model, "full") > model_flops_per_token(model, "causal")


def test_every_published_run_loads_and_projects():
    runs = load_runs()
    assert len({r.id for r in runs}) == len(runs) >= 10 and any(r.held_out for r in runs)
    assert len({r.source.split(",")[0] for r in runs}) >= 3
    for run in runs:
        assert training_of(run).world_size == run.gpus
    row = project_run(next(r for r in runs if r.id.startswith("nemo2412-llama3-8b")))
    assert "error" not in row and row["ratio"] > 0 and row["verdict"] in ("FITS", "AT-RISK", "OOM")


def test_apex_distributed_adam_rows_reduce_their_gradients_in_bf16():
    """The dgxc-benchmarking v25.02 recipes run NeMo's distributed_fused_adam (Apex's DistributedFusedAdam) with
    grad_sync_dtype bf16, whose contiguous gradient buffer is allocated and reduce-scattered in that dtype: the rows
    carry grad_reduce_in_bf16, which halves the gradient bytes the data-parallel reduction moves (and the step
    shows less of it where it was exposed)."""
    rows = [r for r in shipped_runs() if r.id.startswith("dgxc2502-")]
    assert len(rows) == 4 and all(r.training.get("grad_reduce_in_bf16") for r in rows)
    run = next(r for r in rows if r.id == "dgxc2502-gpt3-175b-bf16-128")
    bf16, fp32 = (project_run(dataclasses.replace(run, training={**run.training, "grad_reduce_in_bf16": flag}))
                  for flag in (True, False))
    assert bf16["step_time_s"] < fp32["step_time_s"] and bf16["peak_memory_gib"] < fp32["peak_memory_gib"]

def test_a_long_context_row_projects_the_model_at_its_own_sequence_length():
    """A row's seq_length replaces the model file's: its FLOPs a token (so the tokens its published TFLOP/s stand
    for) and its step follow the longer sequence, as the run's own did."""
    run = max((r for r in shipped_runs() if r.seq_length and "model_tflops_per_gpu" in r.published),
              key=lambda r: r.seq_length)
    shipped = load_model(EXAMPLES / "models" / f"{run.model}.yaml")
    assert run.seq_length >= 8 * shipped.seq_length and model_of(run) == dataclasses.replace(shipped, seq_length=run.seq_length)
    long, short = project_run(run), project_run(dataclasses.replace(run, seq_length=None))
    assert long["published_tokens_per_s_per_gpu"] < short["published_tokens_per_s_per_gpu"] / 2
    assert long["step_time_s"] > short["step_time_s"]


@pytest.mark.parametrize("run", [r for r in shipped_runs() if r.model == "gpt-oss-120b"], ids=lambda r: r.id)
def test_published_gpt_oss_runs_could_not_have_run_unfused_attention(run):
    """GPT-OSS's attention sinks rule FlashAttention out in Transformer Engine, leaving cuDNN's fused kernel
    or the unfused one; the unfused one keeps the b x a x s x s probabilities for the backward, which no
    published GPT-OSS layout has room for (docs/projection.md, GPT-OSS 120B): these runs ran fused."""
    model = load_model(EXAMPLES / "models" / "gpt-oss-120b.yaml")
    hardware = load_hardware(EXAMPLES / "hardware" / f"{run.hardware}.yaml")
    as_run = training_of(run)
    unfused = dataclasses.replace(as_run, attention_backend="unfused", attention_softmax_in_fp32=False)
    fused, bare = (Projector(model, hardware).evaluate(t, run.algorithm()) for t in (as_run, unfused))
    assert isinstance(fused, ProjectionResult) and isinstance(bare, ProjectionResult)
    probabilities = run.training["micro_batch_size"] * model.num_attention_heads * model.seq_length ** 2 * 2
    assert max(bare.peak_memory_bytes) - max(fused.peak_memory_bytes) > probabilities
    assert bare.verdict == "OOM" and (fused.verdict != "OOM" or run.excluded)

def test_fused_cross_entropy_and_narrow_optimizer_state_shrink_memory():
    from primuspipe.projection.activations import ActivationModel
    from primuspipe.projection.parameters import ParamCount
    from primuspipe.projection.static_memory import static_memory

    model = load_model(EXAMPLES / "models" / "llama2-7b.yaml")
    plain, fused = TrainingSpec(), TrainingSpec(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    logits = 4096 * 32000
    assert ActivationModel(model, plain).head() - ActivationModel(model, fused).head() == pytest.approx(logits * (4 - 2))
    # megatron-core's own fused loss makes and keeps the fp32 softmax as its unfused one does
    native = ActivationModel(model, TrainingSpec(cross_entropy_loss_fusion=True))
    assert (native.head(), native.loss_working_set()) == (ActivationModel(model, plain).head(),
                                                          ActivationModel(model, plain).loss_working_set())
    # unfused, the bf16 logits beside the fp32 copy for a moment; fused, or fp32 training (no copy), nothing
    assert ActivationModel(model, plain).loss_working_set() == pytest.approx(logits * 2)
    assert ActivationModel(model, fused).loss_working_set() == ActivationModel(model, TrainingSpec(precision="fp32")
                                                                               ).loss_working_set() == 0
    hardware = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    one = dict(pipeline_model_parallel_size=1, global_batch_size=8)
    te = dict(one, cross_entropy_fusion_impl="te")
    unfused, fused_run = (Projector(model, hardware).evaluate(TrainingSpec(**te, cross_entropy_loss_fusion=f), "1f1b")
                          for f in (False, True))
    assert unfused.memory_breakdown["recompute_working_set"] == pytest.approx(logits * 2)
    assert max(unfused.peak_memory_bytes) - max(fused_run.peak_memory_bytes) == pytest.approx(logits * (4 - 2 + 2))
    assert WorkModel(model, fused).head().forward.memory_bytes < WorkModel(model, plain).head().forward.memory_bytes
    params = ParamCount(dense=1000)
    narrow = TrainingSpec(use_distributed_optimizer=False, use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
                          exp_avg_sq_dtype="bf16", fp8_format="e4m3", fp8_param_gather=True)
    memory = static_memory(params, narrow)
    assert (memory.weights, memory.gradients, memory.optimizer) == (1000, 4000, 8000)  # 1 + 4 + (4 + 2 + 2) bytes
    # MXFP8 weights keep a row-wise and a column-wise FP8 copy, each with an E8M0 scale per 32 elements
    mx = dataclasses.replace(narrow, fp8_recipe="mxfp8")
    assert static_memory(params, mx).weights == pytest.approx(1000 * (2 + 2 / 32))
    assert static_memory(params, dataclasses.replace(mx, fp8_param_gather=False)).weights == 2000
    with pytest.raises(InputError, match="need the precision-aware optimizer"):
        TrainingSpec(exp_avg_dtype="bf16")


@pytest.mark.parametrize("kind, tp, main_grads", [("dense", 1, "fp32"), ("moe", 1, "fp32"), ("moe", 2, "bf16"),
                                                  ("dense", 4, "bf16")])
def test_without_gradient_accumulation_fusion_w_adds_every_weight_gradient_into_its_main_gradient(kind, tp, main_grads):
    model = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                      ffn_hidden_size=4096, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512,
                      moe_shared_expert_intermediate_size=1024, moe_layer_freq="([0]*1+[1]*1)")
    fused = TrainingSpec(pipeline_model_parallel_size=1, tensor_model_parallel_size=tp, expert_model_parallel_size=2,
                         data_parallel_size=2, global_batch_size=2, use_precision_aware_optimizer=main_grads != "fp32",
                         main_grads_dtype=main_grads)
    unfused = dataclasses.replace(fused, gradient_accumulation_fusion=False)
    grad_bytes = 2 + 2 * (4 if main_grads == "fp32" else 2)  # bf16 gradient read, main gradient read and written
    weights = sum(layer_params(model, fused, kind).values(), ParamCount()).total
    for part, count in ((kind, weights), ("head", head_params(model, tp))):
        a, b = WorkModel(model, fused).part(part), WorkModel(model, unfused).part(part)
        assert a.forward == b.forward and a.backward_input == b.backward_input  # only W adds the pass
        assert b.backward_weight.gemms == a.backward_weight.gemms
        assert b.backward_weight.memory_bytes - a.backward_weight.memory_bytes == pytest.approx(count * grad_bytes)
        added = part_times(WorkModel(model, unfused), HW, Calibration())[part].backward_weight \
            - part_times(WorkModel(model, fused), HW, Calibration())[part].backward_weight
        assert added == pytest.approx(count * grad_bytes / HW.hbm_bandwidth_bytes_per_s)


@pytest.mark.parametrize("legacy, expert_gemm, turbo, accumulated", [
    (True, "multi_stream", False, "expert"), (True, "sequential", False, "none"), (True, "multi_stream", True, "none"),
    (False, "multi_stream", False, "none")])
def test_the_legacy_grouped_mlp_accumulates_its_expert_gradients_outside_the_gemm(legacy, expert_gemm, turbo,
                                                                                   accumulated):
    model = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                      ffn_hidden_size=4096, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512,
                      moe_layer_freq="([0]*1+[1]*1)")
    base = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=2, data_parallel_size=2,
                        global_batch_size=2, moe_expert_gemm=expert_gemm)
    turbo_on = dict(enable_primus_turbo=True, use_turbo_grouped_gemm=True) if turbo else {}
    training = dataclasses.replace(base, moe_use_legacy_grouped_gemm=legacy, **turbo_on)
    plain = dataclasses.replace(base, **turbo_on)
    params = sum(layer_params(model, training, "moe").values(), ParamCount())
    expected = {"expert": params.expert, "none": 0}[accumulated] * (2 + 2 * 4)
    for kind, extra in (("moe", expected), ("dense", 0)):  # a dense layer has no experts
        added = (WorkModel(model, training).part(kind).backward_weight.memory_bytes
                 - WorkModel(model, plain).part(kind).backward_weight.memory_bytes)
        assert added == pytest.approx(extra)
    # without gradient_accumulation_fusion every weight is added outside its GEMM, legacy or not
    unfused = dataclasses.replace(training, gradient_accumulation_fusion=False)
    fused = dataclasses.replace(plain, gradient_accumulation_fusion=True)
    assert (WorkModel(model, unfused).part("moe").backward_weight.memory_bytes
            - WorkModel(model, fused).part("moe").backward_weight.memory_bytes) == pytest.approx(params.total * 10)


@pytest.mark.parametrize("model_name,tp,sp,mbs", [("llama3-8b", 1, False, 1), ("llama3-70b", 4, True, 2),
                                                  ("gpt3-20b", 2, False, 1), ("qwen3-30b-a3b", 1, False, 2)])
def test_an_element_wise_kernels_backward_moves_what_it_reads_and_writes(model_name, tp, sp, mbs):
    """Element-wise backward traffic, kernel by kernel, from what each reads and writes (T tokens, H hidden,
    F a TP shard of the MLP width, e bytes): norm forward x -> y (2), backward x, dy -> dx (3); a residual add
    a, b -> c (3), backward the two gradients summed where the stream splits (3); rotary q -> q' (2), back (2);
    SwiGLU 2F -> F (3F), backward 2F and dF -> 2F (5F); GELU F -> F (2F), backward F and dF -> F (3F). The
    backward is no longer twice the forward."""
    model = load_model(EXAMPLES / "models" / f"{model_name}.yaml")
    kind = model.layer_kinds[0]
    if kind != "dense":
        pytest.skip("the dense sum below; MoE layers add permutation and router kernels priced alike (1x)")
    training = TrainingSpec(tensor_model_parallel_size=tp, sequence_parallel=sp, micro_batch_size=mbs,
                            global_batch_size=mbs)
    work = WorkModel(model, training)
    t, t_r, h, e = work.tokens, work.residual_tokens, model.hidden_size, training.activation_bytes
    f = model.ffn / tp
    heads = t * (model.num_attention_heads + model.query_groups) / tp * model.head_dim * e
    rope = model.position_embedding_type == "rope"
    act_forward, act_backward = ((3 * f, 5 * f) if model.swiglu else (2 * f, 3 * f))
    forward = 2 * 2 * t_r * h * e + 2 * 3 * t_r * h * e + (2 * heads if rope else 0) + t * act_forward * e
    backward = 2 * 3 * t_r * h * e + 2 * 3 * t_r * h * e + (2 * heads if rope else 0) + t * act_backward * e
    element = work._elementwise(kind)
    assert element.forward.memory_bytes == pytest.approx(forward)
    assert element.backward_input.memory_bytes == pytest.approx(backward)
    assert element.backward_input.memory_bytes < 2 * element.forward.memory_bytes


def test_an_moe_layers_permutation_and_router_backward_cost_what_their_forward_does():
    model = load_model(EXAMPLES / "models" / "qwen3-30b-a3b.yaml")
    work = WorkModel(model, TrainingSpec(expert_model_parallel_size=8, global_batch_size=8))
    kernels = work._elementwise_kernels("moe")
    assert kernels["permute"] > 0 and kernels["router"] > 0 and kernels["swiglu"] > 0
    expected = sum(b * {"norm": 1.5, "swiglu": 5 / 3}.get(k, 1.0) for k, b in kernels.items())
    assert work._elementwise("moe").backward_input.memory_bytes == pytest.approx(expected)
