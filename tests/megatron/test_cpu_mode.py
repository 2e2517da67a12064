"""megatron-core's own pipeline schedules on CPU/gloo match a pp=1 run of the same model and data.

Each pipeline layout is one gloo launch that runs all of its cases; the pp=1 reference is one more
launch. Grads are compared under global parameter names (local layer numbers mapped to global).
"""

import dataclasses
import functools
import importlib.util
import time

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU mode refuses while CUDA is visible (CUDA_VISIBLE_DEVICES=)"
    ),
]

from megatron_harness import assert_same_tensors  # noqa: E402

from primuspipe.testing.megatron.cpu_step import (  # noqa: E402
    PipelineCase,
    last_stage_losses,
    merged_grads,
    merged_params,
    run_pipeline_cases,
)
from primuspipe.testing.megatron.distributed_cpu import (  # noqa: E402
    ParallelLayout,
    WorkerError,
    run_on_gloo,
)
from primuspipe.errors import ConfigError, PipelineHangError  # noqa: E402

GROUP = "microbatch_group_size_per_vp_stage"
TRAIN = dict(ddp=True, optimizer_step=True)
# MoE with expert parallelism 2 over tensor parallelism 2 (+ sequence parallelism, as Megatron requires),
# the alltoall dispatcher, a shared expert and the aux loss; with the recompute modes and the shared
# expert's side stream the feature matrix (test_feature_matrix.py) does not cover.
MOE_EP = {"sequence_parallel": True, "moe_token_dispatcher_type": "alltoall", "moe_shared_expert_intermediate_size": 32,
          "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}
BLOCK = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}
SELECTIVE_MOE = {"recompute_granularity": "selective", "recompute_modules": ["moe", "shared_experts", "layernorm", "core_attn"]}

# Per layout: (case id, case). m < pp and m not a multiple of pp wherever Megatron accepts them;
# the interleaved schedule needs pp <= microbatch group size <= m.
CASES = {
    ParallelLayout(2): [
        ("m1", PipelineCase(1)),
        ("m3", PipelineCase(3)),
        ("m4", PipelineCase(4)),
        ("moe-m3", PipelineCase(3, model="tiny-moe")),
        ("train-m4", PipelineCase(4, **TRAIN)),
    ],
    ParallelLayout(4): [
        ("m2", PipelineCase(2)),
        ("m5", PipelineCase(5)),
        ("train-m4", PipelineCase(4, **TRAIN)),
    ],
    ParallelLayout(2, vpp=2): [
        ("m2", PipelineCase(2)),
        ("m4", PipelineCase(4)),
        ("m3-group3", PipelineCase(3, config_overrides={GROUP: 3})),
        ("train-m4", PipelineCase(4, **TRAIN)),
    ],
    ParallelLayout(4, vpp=2): [
        ("m4", PipelineCase(4)),
        ("m6-group6", PipelineCase(6, config_overrides={GROUP: 6})),
        ("train-m4", PipelineCase(4, **TRAIN)),
    ],
    ParallelLayout(2, dp=2): [
        ("train-m4", PipelineCase(4, **TRAIN)),
    ],
    ParallelLayout(2, tp=2, ep=2): [
        ("moe-ep2-recompute-block", PipelineCase(4, model="tiny-moe", **TRAIN, config_overrides={**MOE_EP, **BLOCK})),
        ("moe-ep2-recompute-selective", PipelineCase(4, model="tiny-moe", **TRAIN,
                                                     config_overrides={**MOE_EP, **SELECTIVE_MOE})),
        ("moe-ep2-shared-expert-overlap", PipelineCase(4, model="tiny-moe", **TRAIN,
                                                       config_overrides={**MOE_EP, "moe_shared_expert_overlap": True})),
    ],
}


def _reference_key(layout: ParallelLayout, case: PipelineCase):
    return (layout.tp, layout.ep, case.model, case.num_microbatches, case.ddp, case.optimizer_step,
            tuple(sorted((k, str(v)) for k, v in case.config_overrides.items() if k != GROUP)))


@functools.lru_cache(maxsize=None)
def _run(layout: ParallelLayout) -> dict:
    cases = dict(CASES[layout])
    results = run_pipeline_cases(layout, list(cases.values()))
    return dict(zip(cases, results))


@functools.lru_cache(maxsize=None)
def _reference(tp: int = 1, ep: int = 1) -> dict:
    """pp=1 results (same tensor/expert parallelism) for every case above, plus plain m=4."""
    cases = {_reference_key(layout, case): dataclasses.replace(case, config_overrides={
                 k: v for k, v in case.config_overrides.items() if k != GROUP})
             for layout, named in CASES.items() if (layout.tp, layout.ep) == (tp, ep) for _, case in named}
    cases[_reference_key(ParallelLayout(1), PipelineCase(4))] = PipelineCase(4)
    results = run_pipeline_cases(ParallelLayout(1, tp=tp, ep=ep), list(cases.values()))
    return dict(zip(cases, results))


def _assert_same_losses(got: list, want: list) -> None:
    assert len(got) == len(want) and len(want) > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g["lm loss"], w["lm loss"], rtol=0, atol=1e-6)


PARAMS = [
    pytest.param(layout, case_id, id=f"pp{layout.pp}-vpp{layout.vpp}-dp{layout.dp}-tp{layout.tp}-ep{layout.ep}-{case_id}")
    for layout, cases in CASES.items()
    for case_id, _ in cases
]


@pytest.mark.parametrize("layout,case_id", PARAMS)
def test_megatron_schedule_matches_pp1(layout, case_id):
    case = dict(CASES[layout])[case_id]
    got = _run(layout)[case_id]
    want = _reference(layout.tp, layout.ep)[_reference_key(layout, case)]
    assert len(got) == layout.world_size
    _assert_same_losses(last_stage_losses(got), last_stage_losses(want))
    assert_same_tensors(merged_grads(got), merged_grads(want), "grad")
    assert_same_tensors(merged_params(got), merged_params(want), "param")
    non_last = [r for r in got if r.pp_rank != layout.pp - 1]
    assert len(non_last) == layout.world_size // layout.pp * (layout.pp - 1)
    assert all(r.losses == [] for r in non_last), "only the last stage reports losses"


def test_training_step_is_ddp_main_grad_then_sgd():
    """Under DDP the grads are the plain autograd grads, and the optimizer applies p - lr * g."""
    ref, pp1 = _reference(), ParallelLayout(1)
    plain, train = ref[_reference_key(pp1, PipelineCase(4))], ref[_reference_key(pp1, PipelineCase(4, **TRAIN))]
    assert_same_tensors(merged_grads(train), merged_grads(plain), "ddp main_grad")
    lr = PipelineCase(4, **TRAIN).lr
    before, grads = merged_params(plain), merged_grads(plain)
    expected = {name: before[name].add(grads[name], alpha=-lr) for name in before}
    assert_same_tensors(merged_params(train), expected, "param after SGD")
    assert not torch.equal(merged_params(train)["output_layer.weight"], before["output_layer.weight"])


def test_batched_p2p_on_gloo_swaps_tensors_at_pp2_vpp2():
    """Documents a megatron-core bug (docs/design.md §3): with both neighbours on one rank, the batched
    isend/irecv of the interleaved schedule matches an activation with a gradient on gloo. If this
    test fails, Megatron fixed it and ``transformer_config`` may stop forcing ``batch_p2p_comm=False``.
    """
    layout = ParallelLayout(2, vpp=2)
    (got,) = run_pipeline_cases(layout, [PipelineCase(4, config_overrides={"batch_p2p_comm": True})])
    want = _reference()[_reference_key(ParallelLayout(1), PipelineCase(4))]
    got_grads, want_grads = merged_grads(got), merged_grads(want)
    assert any(not torch.allclose(got_grads[n], want_grads[n], atol=1e-4) for n in want_grads)


def test_interleaved_schedule_refuses_fewer_microbatches_than_stages():
    with pytest.raises(WorkerError, match="should range in"):
        run_pipeline_cases(ParallelLayout(2, vpp=2), [PipelineCase(1)])


def test_cpu_mode_is_scoped_to_megatron_modules():
    from primuspipe.backends.megatron.cpu_mode import CPU_MODE_PATCHED_MODULES, enable_cpu_mode

    enable_cpu_mode()
    enable_cpu_mode()  # idempotent
    import sys

    schedules = sys.modules["megatron.core.pipeline_parallel.schedules"]
    assert "megatron.core.pipeline_parallel.schedules" in CPU_MODE_PATCHED_MODULES
    assert schedules.torch is not torch
    assert schedules.torch.zeros(1, device="cuda").device.type == "cpu"
    assert schedules.torch.Tensor is torch.Tensor
    assert sys.modules["megatron.core.transformer.transformer_layer"].torch is torch
    with pytest.raises(AssertionError, match="CUDA"):
        torch.zeros(1, device="cuda")  # the real torch is untouched


def test_launcher_reports_worker_errors_and_hangs():
    def fail(ctx):
        if ctx.rank == 1:
            raise ValueError("boom on rank 1")
        time.sleep(60)  # would hang without fail-fast

    start = time.monotonic()
    with pytest.raises(WorkerError, match="boom on rank 1") as err:
        run_on_gloo(fail, ParallelLayout(2), timeout_s=30)
    assert err.value.rank == 1
    with pytest.raises(PipelineHangError):
        run_on_gloo(lambda ctx: time.sleep(60), ParallelLayout(2), timeout_s=3)
    assert time.monotonic() - start < 20


def test_launcher_returns_results_by_rank():
    got = run_on_gloo(lambda ctx: (ctx.rank, ctx.pp_rank, ctx.dp_rank), ParallelLayout(2, dp=2))
    assert [g[0] for g in got] == [0, 1, 2, 3]
    assert sorted((g[1], g[2]) for g in got) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_user_mistakes_raise_config_error():
    from primuspipe.testing.megatron.tiny_models import get_tiny_model, transformer_config

    with pytest.raises(ConfigError):
        ParallelLayout(0)
    with pytest.raises(ConfigError):
        ParallelLayout(1, vpp=2)
    with pytest.raises(ConfigError):
        PipelineCase(2, optimizer_step=True)
    with pytest.raises(ConfigError):
        PipelineCase(2, model="no-such-model")
    with pytest.raises(ConfigError):
        transformer_config(get_tiny_model("tiny-gpt"), pp=3)
    with pytest.raises(ConfigError):
        transformer_config(get_tiny_model("tiny-gpt"), pp=1, no_such_field=1)
