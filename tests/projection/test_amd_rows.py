"""The AMD hardware files against AMD's measured runs: the MI355X host that binds a fine-grained MoE layer at small
micro-batches (Primus DeepSeek-V2-Lite baseline), and the CDNA 3 sustained GEMM rate (the PyTorch training
container's Llama 3.1 8B); each figure fitted on one published row that is marked as used for fitting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.projection import Projector
from primuspipe.projection.published import load_runs, project_run, training_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
RUNS = {run.id: run for run in load_runs()}
LITE = "primus-mi355x-deepseek-v2-lite-bf16-8-mbs{}-baseline"


def _microbatch_seconds(run_id: str, **hardware_fields) -> float:
    """Seconds one micro-batch takes on a rank (the step over the micro-batches: PP 1, DP sync overlapped)."""
    run = RUNS[run_id]
    hardware = dataclasses.replace(load_hardware(EXAMPLES / "hardware" / f"{run.hardware}.yaml"), **hardware_fields)
    training = training_of(run)
    result = Projector(load_model(EXAMPLES / "models" / f"{run.model}.yaml"), hardware).evaluate(training, run.algorithm())
    return result.step_time_s / result.microbatches


def test_a_fine_grained_moe_layer_on_mi355x_is_host_bound_at_one_and_two_samples():
    """AMD measured 0.382 s a micro-batch at MBS 1 and 0.390 s at MBS 2 (twice the tokens in the same time): the
    host's issue time, which a sync per MoE layer keeps from running ahead, bounds the step until the device has
    more work than that; from MBS 4 the device's time shows. Without the host's cost MBS 1 takes half of MBS 2."""
    one, two, four = (_microbatch_seconds(LITE.format(mbs)) for mbs in (1, 2, 4))
    assert two == pytest.approx(one, rel=0.05)
    assert four > 1.3 * two
    bare_one, bare_two = (_microbatch_seconds(LITE.format(mbs), host_op_seconds=None) for mbs in (1, 2))
    assert bare_one < 0.6 * one and bare_two > 1.5 * bare_one
    assert _microbatch_seconds(LITE.format(8)) == pytest.approx(_microbatch_seconds(LITE.format(8), host_op_seconds=None),
                                                                rel=1e-9)  # MBS 8: the device hides the host


@pytest.mark.parametrize("fitted, hardware, field, checks", [
    (LITE.format(1), ("mi355x",), "host_op_seconds", (LITE.format(2),)),
    ("amd-pytorch-train-mi300x-llama3.1-8b-bf16-fsdp-8", ("mi300x", "mi325x"), "sustained_fraction",
     ("amd-pytorch-train-mi300x-llama3.1-8b-fp8-fsdp-8", "amd-pytorch-train-mi325x-llama3.1-8b-bf16-fsdp-8",
      "amd-pytorch-train-mi325x-llama3.1-8b-fp8-fsdp-8")),
])
def test_each_fitted_amd_figure_has_one_fitting_row_and_holds_on_its_checks(fitted, hardware, field, checks):
    """The fitting row is marked (not held out) and comes out right; the figure is shared by the hardware that
    the source says runs the same way; the rows it was not fitted on land within 10 %."""
    assert not RUNS[fitted].held_out
    assert len({getattr(load_hardware(EXAMPLES / "hardware" / f"{h}.yaml"), field) for h in hardware}) == 1
    assert project_run(RUNS[fitted])["ratio"] == pytest.approx(1.0, abs=0.02)
    for run_id in checks:
        assert 0.9 <= project_run(RUNS[run_id])["ratio"] <= 1.1, run_id
