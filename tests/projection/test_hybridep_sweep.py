"""The HybridEP figures of the Blackwell files against DeepEP hybrid-ep's published call rates
(examples/projection/hardware/measurements/hybridep.yaml): where a file fits a per-rank latency the pair is the
least-squares fit of the call's time over the sweep's group sizes and prices every point within 2 %; a file with one
point takes that call's whole rate and adds no latency; and a layer's dispatch and combine are priced so."""

from __future__ import annotations

import dataclasses
from math import comb

import pytest
import yaml

from primuspipe.projection.comm import hybridep_seconds, layer_comm
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.published import EXAMPLES
from primuspipe.projection.training_spec import TrainingSpec

MEASUREMENTS = EXAMPLES / "hardware" / "measurements" / "hybridep.yaml"
SETS = yaml.safe_load(MEASUREMENTS.read_text())["sets"]


def _calls(measured: dict) -> list[tuple[int, float, float]]:
    """(ranks, bytes a rank receives, seconds of the slower direction) of each point: a token goes once to each rank
    holding one of its ``topk`` distinct experts drawn at random."""
    k, local = measured["topk"], measured["local_experts"]
    calls = []
    for ranks, dispatch, combine in measured["points"]:
        experts = local * ranks
        destinations = ranks * (1 - comb(experts - local, k) / comb(experts, k))
        rows = measured["tokens"] * destinations * measured["hidden"] * 2
        calls.append((ranks, rows, rows / (min(dispatch, combine) * 1e9)))
    return calls


def _fit(calls: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(bandwidth, seconds a rank) minimising the squared error of ``rows / bandwidth + (ranks - 1) x latency``."""
    xs, ys, ts = [rows for _, rows, _ in calls], [ranks - 1 for ranks, _, _ in calls], [t for *_, t in calls]
    sxx, sxy, syy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys)), sum(y * y for y in ys)
    sxt, syt = sum(x * t for x, t in zip(xs, ts)), sum(y * t for y, t in zip(ys, ts))
    det = sxx * syy - sxy * sxy
    inverse, latency = (sxt * syy - syt * sxy) / det, (sxx * syt - sxy * sxt) / det
    return 1 / inverse, latency


@pytest.mark.parametrize("measured", SETS, ids=lambda s: s["hardware"])
def test_the_files_hybridep_figures_are_the_published_calls(measured):
    hardware = load_hardware((MEASUREMENTS.parent / measured["hardware"]).resolve())
    calls = _calls(measured)
    if len(calls) == 1:  # one call: its whole rate, the lower direction's; nothing added for its ranks
        assert hardware.hybridep_rank_latency_s is None
        assert hardware.hybridep_bandwidth_bytes_per_s == pytest.approx(min(measured["points"][0][1:]) * 1e9)
    else:
        bandwidth, latency = _fit(calls)
        assert hardware.hybridep_bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-3)
        assert hardware.hybridep_rank_latency_s == pytest.approx(latency, rel=1e-3)
    for ranks, rows, seconds in calls:
        assert hybridep_seconds(rows, ranks, hardware) == pytest.approx(seconds, rel=0.02), ranks


@pytest.mark.parametrize(("name", "ep"), [("gb200", 32), ("gb200", 64), ("b200", 8)])
def test_a_layers_hybridep_all_to_alls_are_priced_so(name, ep):
    """A DeepSeek-V3 MoE layer's F (dispatch and combine) on HybridEP inside the NVLink domain: its received rows
    (destination ranks x tokens x hidden x 2 bytes) by :func:`hybridep_seconds`, twice."""
    hardware = load_hardware(EXAMPLES / "hardware" / f"{name}.yaml")
    model = load_model(EXAMPLES / "models" / "deepseek-v3.yaml")
    training = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=ep, data_parallel_size=ep,
                            global_batch_size=ep, moe_token_dispatcher_type="flex",
                            moe_flex_dispatcher_backend="hybridep", moe_router_force_load_balancing=True)
    ep_seconds = layer_comm(model, training, hardware, "moe").ep[0]
    no_latency = dataclasses.replace(hardware, hybridep_rank_latency_s=None)
    rows_seconds = layer_comm(model, training, no_latency, "moe").ep[0] / 2  # one call's rows over the bandwidth
    assert ep_seconds == pytest.approx(2 * (rows_seconds + (ep - 1) * (hardware.hybridep_rank_latency_s or 0.0)))
    rows = rows_seconds * hardware.hybridep_bandwidth_bytes_per_s
    tokens = model.seq_length
    assert 3.9 < rows / (tokens * model.hidden_size * 2) < 8  # a token reaches between 4 and 8 ranks


def test_a_rank_latency_without_its_bandwidth_is_refused():
    """The latency is half of a fit; alone it would be silently unused (the fabric's model times the call)."""
    gb200 = load_hardware(EXAMPLES / "hardware" / "gb200.yaml")
    with pytest.raises(InputError, match="hybridep_rank_latency_s"):
        dataclasses.replace(gb200, hybridep_bandwidth_bytes_per_s=None)
