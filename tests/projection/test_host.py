"""Host-side time: what the CPU issues per layer, the device-to-host sync of dropless MoE dispatch, CUDA graphs,
and the count of host work against the operations a real megatron-core layer dispatches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from published_rows import shipped_runs
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.compute import Calibration, WorkModel, part_times
from primuspipe.projection.host import (FEATURES, OPS, TE_LINEAR_OPS, host_bound, layer_host, moe_small_kernels,
                                        moe_stream_kernels)
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.projection import Projector
from primuspipe.projection.published import training_of
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec, check_compatible

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
QWEN = load_model(EXAMPLES / "models" / "qwen3-30b-a3b.yaml")
B200 = load_hardware(EXAMPLES / "hardware" / "b200.yaml")


def moe_training(**fields) -> TrainingSpec:
    base = dict(pipeline_model_parallel_size=1, expert_model_parallel_size=8, data_parallel_size=8,
                global_batch_size=64, precision="bf16")
    return TrainingSpec(**(base | fields))


def test_a_sync_bounds_the_forward_alone_and_otherwise_the_host_runs_ahead():
    device, host = (1.0, 2.0, 1.0), (1.5, 1.0, 0.5)
    assert host_bound(device, host, syncs=True) == (1.5, 2.0, 1.0)  # forward waits; B and W absorb their host time
    assert host_bound(device, host, syncs=False) == (1.0, 2.0, 1.0)  # 3.0 s of host under 4.0 s of device
    slow = (3.0, 3.0, 2.0)
    assert host_bound(device, slow, syncs=False) == pytest.approx((2.0, 4.0, 2.0))  # all passes stretched by 8/4
    assert host_bound(device, slow, syncs=True) == pytest.approx((3.0, 5.0 / 3 * 2.0, 5.0 / 3 * 1.0))
    assert host_bound(device, (0.0, 0.0, 0.0), syncs=True) == device


def test_host_work_follows_experts_fp8_padding_and_cuda_graphs():
    dropless = layer_host(QWEN, moe_training(), "moe")
    assert dropless.syncs and dropless.forward.launches == 2 * 16  # one GEMM per local expert per grouped linear
    more = layer_host(QWEN, moe_training(expert_model_parallel_size=4, data_parallel_size=4), "moe")
    assert more.forward.launches == 2 * 32 and more.forward.ops == dropless.forward.ops
    fp8 = layer_host(QWEN, moe_training(fp8_format="hybrid"), "moe")
    assert fp8.forward.launches == 2 * 2 * 16  # and a cast per expert
    linears = 4 * (TE_LINEAR_OPS[True] - TE_LINEAR_OPS[False])  # qkv, proj, fc1, fc2
    assert fp8.forward.ops - dropless.forward.ops == linears + OPS["moe_fp8_padding"]  # dropless counts arrive unaligned
    aligned = layer_host(QWEN, moe_training(fp8_format="hybrid", moe_router_padding_for_quantization=True), "moe")
    assert fp8.forward.ops - aligned.forward.ops == OPS["moe_fp8_padding"]
    padded = layer_host(QWEN, moe_training(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), "moe")
    assert not padded.syncs and padded.forward.ops < dropless.forward.ops  # no token counts copied to the host
    router = layer_host(QWEN, moe_training(cuda_graph_impl="transformer_engine",
                                           cuda_graph_modules=("attn", "moe_router", "moe_preprocess")), "moe")
    assert router.syncs and router.forward.ops < dropless.forward.ops and router.forward.launches == dropless.forward.launches
    whole = layer_host(QWEN, moe_training(cuda_graph_impl="local", moe_expert_capacity_factor=1.0,
                                          moe_pad_expert_input_to_capacity=True), "moe")
    assert (whole.forward.ops, whole.forward.launches, whole.syncs) == (4, 0, False)  # four regions, one replay each
    with pytest.raises(InputError, match="padded to capacity"):
        check_compatible(QWEN, moe_training(cuda_graph_impl="local"))
    with pytest.raises(InputError, match="moe_router"):
        moe_training(cuda_graph_impl="local", cuda_graph_modules=("moe_preprocess",))
    with pytest.raises(InputError, match="capacity"):
        moe_training(moe_pad_expert_input_to_capacity=True)
    t = moe_training(moe_expert_capacity_factor=1.25, moe_expert_load_imbalance=1.5)
    assert t.load_imbalance == 1.25 and dataclasses.replace(t, moe_pad_expert_input_to_capacity=True).load_imbalance == 1.25
    assert moe_training(moe_expert_capacity_factor=2.0, moe_expert_load_imbalance=1.5).load_imbalance == 1.5


def _tokens_per_s(run_id: str, hardware_fields: dict, **training_fields) -> float:
    run = next(r for r in shipped_runs() if r.id == run_id)
    hardware = dataclasses.replace(load_hardware(EXAMPLES / "hardware" / f"{run.hardware}.yaml"), **hardware_fields)
    training = dataclasses.replace(training_of(run), **training_fields)
    return Projector(load_model(EXAMPLES / "models" / f"{run.model}.yaml"), hardware).evaluate(
        training, run.algorithm()).tokens_per_s_per_gpu


@pytest.mark.parametrize("run_id", ["mbridge2511-llama3-8b-fp8cs-8", "nemo2412-llama2-13b-fp8-16",
                                    "mbridge2509-qwen3-30b-a3b-fp8-16", "mbridge2511-b200-llama3-8b-fp8cs-8"])
def test_host_time_leaves_runs_with_enough_gpu_work_alone(run_id):
    assert _tokens_per_s(run_id, {}) == pytest.approx(_tokens_per_s(run_id, {"host_op_seconds": None}), rel=1e-9)


def test_host_time_slows_a_fine_grained_moe_layer_with_little_gpu_work():
    run_id = "mbridge2511-b200-qwen3-30b-a3b-mxfp8-8"  # its recipe graphs the router; eager here, so the host binds
    # eager and unfused (the recipe fuses router and permutation): the host's most work
    eager = {"cuda_graph_impl": "none", "cuda_graph_modules": (), "moe_router_fusion": False, "moe_permute_fusion": False}
    # the device's least work (no small-kernel cost, no GEMM or attention falloff by shape): the host's share shows most
    bare = {"moe_kernel_seconds": None, "gemm_half_intensity": None, "attention_length_rates": None,
            "attention_backward_length_rates": None}
    with_host = _tokens_per_s(run_id, bare, **eager)
    without = _tokens_per_s(run_id, bare | {"host_op_seconds": None}, **eager)
    assert with_host < 0.98 * without
    ten_times = _tokens_per_s(run_id, bare | {"host_op_seconds": 10 * B200.host_op_seconds}, **eager)
    assert ten_times < 0.5 * with_host  # host-bound: the step follows the host
    graphed = _tokens_per_s(run_id, bare)
    assert with_host < graphed <= without  # CUDA graphs over router and pre-processing take host work away


@pytest.mark.slow
def test_the_count_follows_the_operations_a_real_megatron_layer_dispatches():
    """aten operations a real megatron-core layer (local spec, CPU) dispatches forward and backward, priced at
    the hardware file's op cost over the aten operations of the torch.nn.Linear forward it was measured on,
    against the structural count (BF16): within a factor 1.5 for a dense layer and MoE layers of 4 and 16
    local experts (the local spec loops over experts in Python, heavier per expert than Transformer Engine's
    grouped GEMM, lighter per layer than its modules)."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        counted = pool.apply(_count_real_layers)
    linear_ops, layers = counted
    per_aten = B200.host_op_seconds / linear_ops
    for (name, ep), aten in layers.items():
        model = load_model(EXAMPLES / "models" / f"{name}.yaml")
        t = moe_training(expert_model_parallel_size=ep, data_parallel_size=ep) if model.is_moe else TrainingSpec(
            pipeline_model_parallel_size=1, global_batch_size=1)
        ours = sum(layer_host(model, t, model.layer_kinds[-1]).seconds(B200))
        assert 1 / 1.5 < ours / (aten * per_aten) < 1.5, (name, ep, ours, aten * per_aten)


def _count_real_layers():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
    from primuspipe.projection.benchmark.layers import _on_one_rank, benchmark_shape
    from primuspipe.projection.benchmark.megatron_model import build_layer, transformer_config

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def counted(run) -> int:
        Count.n = 0
        with Count():
            run()
        return Count.n

    def layers():
        out = {}
        for name, ep in (("llama3-8b", 1), ("qwen3-30b-a3b", 32), ("qwen3-30b-a3b", 8)):
            m = load_model(EXAMPLES / "models" / f"{name}.yaml")
            small = dict(hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                         seq_length=64) | ({"moe_ffn_hidden_size": 64} if m.is_moe else {})
            t = moe_training(expert_model_parallel_size=ep, data_parallel_size=ep, precision="fp32",
                             moe_router_force_load_balancing=True) if m.is_moe else TrainingSpec(
                pipeline_model_parallel_size=1, global_batch_size=1, precision="fp32")
            bm, bt = benchmark_shape(dataclasses.replace(m, **small), t)
            layer = build_layer(bm, bt, bm.layer_kinds[-1], transformer_config(bm, bt))
            x = torch.randn(64, 1, 128, requires_grad=True)
            mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).triu(1)
            out[(name, ep)] = 0
            for _ in range(2):  # the second pass, after lazy set-up
                y = [None]
                forward = counted(lambda: y.__setitem__(0, layer(x, attention_mask=mask)[0]))
                out[(name, ep)] = forward + counted(lambda: y[0].sum().backward())
        return out

    enable_cpu_mode()
    torch.set_num_threads(1)
    linear, x = torch.nn.Linear(64, 64), torch.randn(16, 2, 64)
    return counted(lambda: linear(x)), _on_one_rank("gloo", layers)


def test_small_moe_kernels_add_device_time_to_moe_layers_only():
    """moe_kernel_seconds: each kernel of the routing, dispatch and expert loop adds its fixed cost to the MoE
    part's passes -- counted whether CUDA graphs replay the kernels or not -- and nothing to a dense layer."""
    t = moe_training()
    f, b, w = moe_small_kernels(QWEN, t)
    assert f == b > w > 2 * 16  # at least each expert's GEMM in both grouped linears
    graphed = moe_training(cuda_graph_impl="transformer_engine", cuda_graph_modules=("attn", "moe_router", "moe_preprocess"))
    assert moe_small_kernels(QWEN, graphed) == (f, b, w)  # graphs take the host's work away, not the kernels
    more = moe_small_kernels(QWEN, moe_training(expert_model_parallel_size=4, data_parallel_size=4))
    assert more[0] - f == 2 * 16  # twice the local experts: one more GEMM per added expert per grouped linear
    off = dataclasses.replace(B200, moe_kernel_seconds=None)
    with_kernels, without = part_times(WorkModel(QWEN, t), B200, Calibration()), part_times(WorkModel(QWEN, t), off, Calibration())
    added = [getattr(with_kernels["moe"], p) - getattr(without["moe"], p) for p in ("forward", "backward_input", "backward_weight")]
    each = B200.moe_kernel_seconds + B200.stream_launch_gap_seconds  # no graphs: every kernel launched into a stream
    assert added == pytest.approx([n * each for n in (f, b, w)])
    assert with_kernels["head"] == without["head"]
    llama = load_model(EXAMPLES / "models" / "llama3-8b.yaml")
    dense = TrainingSpec(pipeline_model_parallel_size=1, global_batch_size=8)
    assert part_times(WorkModel(llama, dense), B200, Calibration()) == part_times(WorkModel(llama, dense), off, Calibration())
    measured = Calibration({("moe", "forward"): 1.0})  # a measured factor already holds the kernels' cost
    assert part_times(WorkModel(QWEN, t), B200, measured)["moe"].forward == without["moe"].forward


GRAPHS = [dict(), dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=("attn",)),
          dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=("moe_router",)),
          dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=("moe_router", "moe_preprocess")),
          dict(cuda_graph_impl="local", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
          dict(cuda_graph_impl="full_iteration", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)]


@pytest.mark.parametrize("graphs", GRAPHS, ids=lambda g: "+".join(g.get("cuda_graph_modules", ())) or g.get("cuda_graph_impl", "none"))
@pytest.mark.parametrize("fields", [dict(), dict(precision="fp8"), dict(moe_router_fusion=True, moe_permute_fusion=True)],
                         ids=["bf16", "fp8", "fused"])
def test_cuda_graphs_take_the_stream_launch_gap_off_the_kernels_they_capture_and_only_those(graphs, fields):
    """stream_launch_gap_seconds: a small MoE kernel launched into a stream pays the launch gap, the same kernel
    in a graph replay does not; the kernels' own fixed cost (moe_kernel_seconds) is paid either way."""
    t = moe_training(**fields, **graphs)
    kernels, streamed = moe_small_kernels(QWEN, t), moe_stream_kernels(QWEN, t)
    if not any(t.captures(r) for r in ("moe_router", "moe_preprocess", "moe")):
        assert streamed == kernels
    elif t.captures("moe") and t.captures("moe_router") and t.captures("moe_preprocess"):
        assert streamed == (0, 0, 0)
    else:
        assert all(0 < s < n for s, n in zip(streamed[:2], kernels[:2]))
    no_gap = dataclasses.replace(B200, stream_launch_gap_seconds=None)
    work = WorkModel(QWEN, t)
    with_gap, without = part_times(work, B200, Calibration())["moe"], part_times(work, no_gap, Calibration())["moe"]
    added = [getattr(with_gap, p) - getattr(without, p) for p in ("forward", "backward_input", "backward_weight")]
    assert added == pytest.approx([s * B200.stream_launch_gap_seconds for s in streamed], abs=1e-12)
    stream = part_times(WorkModel(QWEN, moe_training(**fields)), B200, Calibration())["moe"]
    assert with_gap.forward <= stream.forward  # a graph never makes the small kernels slower


@pytest.mark.parametrize("field", ["moe_kernel_seconds", "moe_sync_host_op_seconds", "stream_launch_gap_seconds"])
@pytest.mark.parametrize("value, message", [(0, "must be positive"), (-5e-6, "finite number >= 0"), (float("nan"), "finite number >= 0")])
def test_bad_moe_kernel_or_sync_host_seconds_is_refused_with_one_line(tmp_path, field, value, message):
    import yaml

    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load((EXAMPLES / "hardware" / "b200.yaml").read_text()), field: value}))
    with pytest.raises(InputError, match=message) as raised:
        load_hardware(path)
    assert field in str(raised.value).splitlines()[0]


MI355X = load_hardware(EXAMPLES / "hardware" / "mi355x.yaml")
TURBO = dict(enable_primus_turbo=True, moe_router_dtype="fp32")


@pytest.mark.parametrize("stage, on", [
    (0, set()),
    (1, {"moe_use_fused_router_with_aux_score", "moe_permute_fusion"}),
    (2, {"moe_use_fused_router_with_aux_score", "moe_permute_fusion", "use_turbo_deepep", "use_turbo_grouped_gemm"}),
    (3, {"moe_use_fused_router_with_aux_score", "moe_permute_fusion", "use_turbo_deepep", "use_turbo_grouped_gemm",
         "use_turbo_fused_act_with_probs"}),
])
def test_each_sync_free_stage_turns_on_what_primus_turns_on(stage, on):
    switches = {"moe_use_fused_router_with_aux_score", "moe_permute_fusion", "use_turbo_deepep",
                "use_turbo_grouped_gemm", "use_turbo_fused_act_with_probs"}
    t = moe_training(**TURBO, turbo_sync_free_moe_stage=stage, use_turbo_grouped_gemm=stage > 1)
    assert {n for n in switches if getattr(t, n)} == on
    assert t.moe_token_dispatcher_type == ("flex" if stage > 1 else "alltoall")  # Primus's DeepEP patch sets flex
    assert t.moe_syncs_free == (stage > 1)


@pytest.mark.parametrize("fields, message", [
    (dict(TURBO, turbo_sync_free_moe_stage=4), "stages 0-3"),
    (dict(turbo_sync_free_moe_stage=1), "enable_primus_turbo"),
    (dict(use_turbo_deepep=True, moe_router_dtype="fp32"), "enable_primus_turbo"),
    (dict(TURBO, turbo_sync_free_moe_stage=2), "use_turbo_grouped_gemm"),
    (dict(enable_primus_turbo=True, use_turbo_deepep=True), "float32 probabilities"),
    (dict(TURBO, use_turbo_deepep=True, expert_model_parallel_size=1), "expert"),
])
def test_primus_rules_for_its_moe_features_are_kept(fields, message):
    with pytest.raises(InputError, match=message):
        moe_training(**fields)


def test_fusions_cut_the_host_ops_of_their_groups_and_stage_2_the_wait():
    base = layer_host(QWEN, moe_training(), "moe")  # 16 local experts: the received copies are sorted
    router = layer_host(QWEN, moe_training(moe_router_fusion=True), "moe")
    assert base.forward.ops - router.forward.ops == 3  # score function and top-k: 4 ops -> 1
    turbo_router = layer_host(QWEN, moe_training(**TURBO, moe_use_fused_router_with_aux_score=True), "moe")
    assert base.forward.ops - turbo_router.forward.ops == 3 + 3  # ... and the auxiliary loss's 3 in it
    permute = layer_host(QWEN, moe_training(moe_permute_fusion=True), "moe")
    assert base.forward.ops - permute.forward.ops == 2 + 2 + 1  # permute 3 -> 1, two sorts 2 -> 1 each, unpermute 2 -> 1
    assert base.backward_input.ops - permute.backward_input.ops == 5 and permute.syncs
    stage1 = layer_host(QWEN, moe_training(**TURBO, turbo_sync_free_moe_stage=1, use_turbo_deepep=True), "moe")
    assert base.forward.ops - stage1.forward.ops == 6 + 5 and stage1.syncs  # DeepEP still waits for counts
    assert stage1.forward.launches == base.forward.launches  # the per-expert GEMMs stay
    grouped = layer_host(QWEN, moe_training(**TURBO, use_turbo_grouped_gemm=True), "moe")
    assert grouped.forward.launches == 2  # one launch per grouped linear for all 16 experts
    stage2 = layer_host(QWEN, moe_training(**TURBO, turbo_sync_free_moe_stage=2, use_turbo_grouped_gemm=True), "moe")
    assert not stage2.syncs and stage1.forward.ops - stage2.forward.ops == 6  # no copies of the counts to the host
    stage3 = layer_host(QWEN, moe_training(**TURBO, turbo_sync_free_moe_stage=3, use_turbo_grouped_gemm=True), "moe")
    assert stage2.forward.ops - stage3.forward.ops == 1  # activation and probability weighting fused


def test_sync_free_stage_2_takes_the_mi355x_moe_layer_off_its_host_price():
    """On the MI355X only MoE layers that wait for token counts are host-priced (moe_sync_host_op_seconds): the
    baseline MBS 1 row is host-bound; from stage 2 nothing waits, and the projection is the device's."""
    run = next(r for r in shipped_runs() if r.id == "primus-mi355x-deepseek-v2-lite-bf16-8-mbs1-baseline")
    model = load_model(EXAMPLES / "models" / f"{run.model}.yaml")
    base = training_of(run)
    free = dataclasses.replace(base, **TURBO, turbo_sync_free_moe_stage=2, use_turbo_grouped_gemm=True)
    stage1 = dataclasses.replace(base, **TURBO, turbo_sync_free_moe_stage=1)
    parts = {name: part_times(WorkModel(model, t), MI355X, Calibration())["moe"]
             for name, t in (("base", base), ("stage1", stage1), ("free", free))}
    assert parts["base"].host_syncs and parts["stage1"].host_syncs and not parts["free"].host_syncs
    assert 0 < parts["stage1"].host[0] < parts["base"].host[0] and parts["free"].host == (0.0, 0.0, 0.0)
    speed = {name: Projector(model, MI355X).evaluate(t, "1f1b").tokens_per_s_per_gpu
             for name, t in (("base", base), ("stage1", stage1), ("free", free))}
    assert speed["base"] < speed["stage1"] < speed["free"]


DEEPSEEK_V2 = load_model(EXAMPLES / "models" / "deepseek-v2.yaml")


def _deepseek_v2_training(**fields) -> TrainingSpec:
    return moe_training(expert_model_parallel_size=8, data_parallel_size=8, apply_rope_fusion=False) if not fields \
        else dataclasses.replace(_deepseek_v2_training(), **fields)


def test_mla_and_group_limited_routing_add_their_ops_to_the_layer():
    """DeepSeek-V2's layer against the same layer without MLA and without routing groups (BF16, TP 1, unfused
    rotary embedding, unfused router): three more linear modules (q down, q up, kv down, kv up, proj against
    qkv, proj) at 3 ops each, the input norm on its own (+1), no per-head qk norms (-2), the unfused rotary
    assembly (+5 forward, +9 in B), the group picks (+9 forward, +1 in B)."""
    plain = dataclasses.replace(DEEPSEEK_V2, multi_latent_attention=False, q_lora_rank=None,
                                moe_router_num_groups=None, moe_router_group_topk=None)
    t = _deepseek_v2_training()
    ours, theirs = layer_host(DEEPSEEK_V2, t, "moe"), layer_host(plain, t, "moe")
    assert ours.forward.ops - theirs.forward.ops == 9 + 1 - 2 + 5 + 9
    assert ours.backward_input.ops - theirs.backward_input.ops == 9 + 1 - 2 + 9 + 1
    assert ours.backward_weight.ops - theirs.backward_weight.ops == 9
    assert ours.forward.launches == theirs.forward.launches
    lite_query = dataclasses.replace(DEEPSEEK_V2, q_lora_rank=None)  # DeepSeek-V2-Lite's: one query projection
    assert ours.forward.ops - layer_host(lite_query, t, "moe").forward.ops == TE_LINEAR_OPS[False]
    fused = layer_host(DEEPSEEK_V2, _deepseek_v2_training(apply_rope_fusion=True, moe_router_fusion=True), "moe")
    assert ours.forward.ops - fused.forward.ops == 5 + 9 + (OPS["moe_score_topk"] - 1)  # fused top-k takes the groups
    sp = _deepseek_v2_training(tensor_model_parallel_size=2, sequence_parallel=True, data_parallel_size=4)
    no_sp = dataclasses.replace(plain, multi_latent_attention=True, q_lora_rank=1536)
    assert layer_host(DEEPSEEK_V2, sp, "moe").forward.ops - layer_host(DEEPSEEK_V2, t, "moe").forward.ops == 1
    assert layer_host(no_sp, t, "dense").forward.ops - layer_host(plain, t, "dense").forward.ops == 9 + 1 - 2 + 5


def _kernels(run) -> int:
    """aten operations ``run`` dispatches that launch a kernel (views and ``_unsafe_view`` alias their input)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not (func.is_view or func is torch.ops.aten._unsafe_view.default)
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.n


def _forward_and_backward(function, x, *args, **kwargs) -> tuple[int, int]:
    """Kernels of ``function(x, ...)`` forward and of its backward from a weighted sum of its first output."""
    import torch

    out = [None]
    forward = _kernels(lambda: out.__setitem__(0, function(x, *args, **kwargs)))
    y = out[0][0] if isinstance(out[0], tuple) else out[0]
    weights = torch.rand(y.shape)
    return forward, _kernels(lambda: (y * weights).sum().backward())


def test_group_limited_routing_and_the_mla_rotary_interleave_launch_what_megatron_core_launches():
    """megatron-core's own router and rotary functions on CPU, with and without the feature: the kernels they add
    are the counts in FEATURES (the top-k with DeepSeek-V2's 8 groups, 3 picked, pre-softmax; the rotary
    embedding's MLA interleave, twice a layer)."""
    import torch

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    m = DEEPSEEK_V2
    logits = lambda: torch.randn(64, m.num_experts, requires_grad=True)  # noqa: E731
    route = dict(use_pre_softmax=m.moe_router_pre_softmax, score_function=m.moe_router_score_function)
    free = _forward_and_backward(topk_routing_with_score_function, logits(), m.moe_router_topk, **route)
    grouped = _forward_and_backward(topk_routing_with_score_function, logits(), m.moe_router_topk, **route,
                                    num_groups=m.moe_router_num_groups, group_topk=m.moe_router_group_topk)
    feature = FEATURES["group_limited_routing"]
    assert (grouped[0] - free[0], grouped[1] - free[1]) == (feature.forward, feature.backward)

    rotary = lambda: torch.randn(32, 1, 4, m.qk_pos_emb_head_dim, requires_grad=True)  # noqa: E731
    freqs = torch.randn(32, 1, 1, m.qk_pos_emb_head_dim)
    gqa = _forward_and_backward(_apply_rotary_pos_emb_bshd, rotary(), freqs, mla_rotary_interleaved=False)
    mla = _forward_and_backward(_apply_rotary_pos_emb_bshd, rotary(), freqs, mla_rotary_interleaved=True)
    feature = FEATURES["mla_unfused_rope"]
    assert (2 * (mla[0] - gqa[0]) + 3, 2 * (mla[1] - gqa[1]) + 3) == (feature.forward, feature.backward)
