"""The B200, GB200 and GB300 files' attention figures against the cuDNN fused-attention rates NVIDIA published for each
(examples/projection/hardware/measurements/attention.yaml): the model reproduces each published forward and backward
as an isolated kernel (sustained_fraction 1), every length its tables give is a published point, and a B200 layer's
attention time in a projection is priced at them."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from primuspipe.projection.compute import Calibration, Work, WorkModel, part_times
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.published import EXAMPLES
from primuspipe.projection.training_spec import TrainingSpec

MEASUREMENTS = EXAMPLES / "hardware" / "measurements" / "attention.yaml"
SETS = yaml.safe_load(MEASUREMENTS.read_text())["sets"]
B200 = EXAMPLES / "hardware" / "b200.yaml"


def _points() -> list[tuple[dict, int, str, float]]:
    """(set, tokens a sequence, pass, published TFLOP/s) of every published point."""
    return [(s, point[0], name, rate) for s in SETS for point in s["points"]
            for name, rate in zip(("forward", "backward"), point[1:])]


@pytest.mark.parametrize("point", _points(), ids=lambda p: f"{p[0]['kernel']}-{p[2]}-{p[1]}")
def test_each_attention_figure_gives_the_published_rate(point):
    """The file's figures are the published rates to their three decimals (0.555 of 2,250 for the 8k forward):
    within 0.2 % of each, at the benchmark's own shape."""
    measured, length, pass_name, tflops = point
    hardware = load_hardware((MEASUREMENTS.parent / measured["hardware"]).resolve())
    isolated = dataclasses.replace(hardware, sustained_fraction=1.0)
    flops = (4 * measured["batch"] * measured["heads"] * length * length * measured["head_dim"] / 2
             * (2.5 if pass_name == "backward" else 1.0))
    seconds = Work(attention_flops=flops).attention_seconds(isolated, measured["precision"], length,
                                                            measured["head_dim"], pass_name == "backward")
    assert flops / seconds / 1e12 == pytest.approx(tflops, rel=0.002)


@pytest.mark.parametrize("name", ["b200", "gb200", "gb300"])
def test_every_length_the_blackwell_tables_give_is_a_published_point(name):
    """A table row without a published point behind it would be an unsourced figure; a published point the
    tables skip would leave the interpolation unchecked there."""
    hardware = load_hardware(EXAMPLES / "hardware" / f"{name}.yaml")
    published = {p[0] for s in SETS if s["hardware"] == f"../{name}.yaml" for p in s["points"]}
    assert {n for n, _ in hardware.attention_length_rates} == published
    assert {n for n, _ in hardware.attention_backward_length_rates} == published
    assert dict(hardware.attention_length_rates)[8192] == 1.0  # attention_efficiency is the 8k forward


def test_a_b200_projection_prices_attention_at_the_published_rates():
    """Llama 3 70B at 8,192 tokens with CP 2 (the NeMo 25.02 B200 row's layout): each ring step's kernels see
    4,096 queries, so the forward runs at 0.798 and the backward at 0.642 of the 8k forward's 0.555 of the peak,
    times the file's sustained fraction."""
    b200 = load_hardware(B200)
    training = TrainingSpec(micro_batch_size=1, tensor_model_parallel_size=2, context_parallel_size=2,
                            pipeline_model_parallel_size=4, sequence_parallel=True, global_batch_size=128)
    work = WorkModel(load_model(EXAMPLES / "models" / "llama3-70b.yaml"), training)
    layer = work.layer("dense")
    times = part_times(work, b200, Calibration())["dense"]
    peak = 2250e12 * 0.555 * b200.sustained_fraction
    assert times.attention[0] == pytest.approx(layer.forward.attention_flops / (peak * 0.798))
    assert times.attention[1] == pytest.approx(layer.backward_input.attention_flops / (peak * 0.642))
    assert times.attention[2] == 0


HEAD_DIMS = yaml.safe_load(MEASUREMENTS.read_text())["head_dims"]


@pytest.mark.parametrize("measured", HEAD_DIMS, ids=lambda m: m["hardware"])
def test_the_narrow_head_rates_are_one_runs_64_wide_kernel_against_its_128_wide_one(measured):
    """Each pass's rate at head dim 64 is the published 64-wide kernel's TFLOP/s over the 128-wide one's of the same
    run, the windowed kernel's work counted as the projection counts it (the key blocks it visits: ``window_share``
    of a model windowed on every layer); rates to three decimals."""
    hardware = load_hardware((MEASUREMENTS.parent / measured["hardware"]).resolve())
    narrow, wide, tokens = measured["narrow"], measured["wide"], measured["tokens"]
    gpt_oss = load_model(EXAMPLES / "models" / "gpt-oss-120b.yaml")
    windowed = dataclasses.replace(gpt_oss, seq_length=tokens, window_size=(narrow["window"], 0),
                                   window_attn_skip_freq=gpt_oss.num_layers + 1)
    share = WorkModel(windowed, TrainingSpec(micro_batch_size=1, global_batch_size=1)).window_share
    assert 0.4 < share < 0.5  # a 1,024-token window at 4k: 252 of causal's 528 key blocks

    def work(kernel: dict) -> float:  # one pass's FLOPs over the forward's, as this model counts them
        return 4 * kernel["batch"] * kernel["heads"] * tokens ** 2 * kernel["head_dim"] / 2

    rates = [work(narrow) * share / n / (work(wide) / w) for n, w in zip(narrow["ms"], wide["ms"])]
    assert hardware.attention_rate(None, 64) == pytest.approx(rates[0], abs=5e-4)
    assert hardware.attention_rate(None, 64, backward=True) == pytest.approx(rates[1], abs=5e-4)
    assert hardware.attention_rate(None, 128) == hardware.attention_rate(None, 128, backward=True) == 1.0
