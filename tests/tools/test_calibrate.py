"""Measured cost models: simulate with known costs -> calibrate -> the same costs and step time."""

from dataclasses import replace

import pytest
import yaml
from simulator_support import simulate_rows

from primuspipe.errors import TableFormatError
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, Link, P2PCost, simulate
from primuspipe.calibration.measure import measure_costs
from primuspipe.calibration.replay import executed_table
from primuspipe.tools.pp_vis import load_iterations

P2P = P2PCost(intra_node=Link(0.05), inter_node=Link(0.05))


def _timeline(algorithm, pp, m, vpp, f, b, w, **rest):
    cost = CostModel.per_stage(pp * vpp, f, b, w, p2p=P2P, time_unit="s", **rest)
    return simulate(build_schedule(algorithm, pp, m, vpp, cost=cost), cost)  # as `simulate` builds it


def test_split_backward_costs_are_recovered_per_stage_and_reproduce_the_step(tmp_path, capsys):
    f, b, w = [1.0, 1.25, 0.75, 1.0], [1.5, 2.0, 1.0, 1.5], [0.5, 1.0, 0.75, 0.5]
    result = _timeline("zb-h1", 4, 8, 1, f, b, w)
    measured = measure_costs([result.timeline()])
    assert (measured.forward, measured.backward_input, measured.backward_weight) == (tuple(f), tuple(b), tuple(w))
    assert measured.fused_backward is None and measured.fb_overlap is None
    assert measured.p2p_latency == 0.05
    path = tmp_path / "cost.yaml"
    path.write_text(measured.to_yaml())
    data = yaml.safe_load(path.read_text())
    assert data["compute"] == {"f": f, "b": b, "w": w} and data["time_unit"] == "s"
    (row,) = simulate_rows(capsys, "--algorithm", "zb-h1", "--pp", "4", "-m", "8", "--cost", str(path))
    assert row["step_time"] == pytest.approx(result.step_time, rel=1e-12)


def test_vpp2_file_is_per_1f1b_stage_unless_asked_per_model_stage(tmp_path, capsys):
    f = [0.5, 0.75, 0.5, 0.5, 0.25, 0.5]  # model stages; 1F1B stage k = model stages 2k, 2k+1
    result = _timeline("interleaved-1f1b", 3, 6, 2, f, 0.5, 0.5)
    measured = measure_costs([result.timeline()])
    assert measured.forward == tuple(f)
    assert measured.backward_input == measured.backward_weight == (0.5,) * 6, "BW split in half"
    assert measured.fused_backward == (1.0,) * 6 and any("fused BW" in n for n in measured.notes)
    portable = measured.cost_dict()
    assert portable["compute"]["f"] == [1.25, 1.0, 0.75] and portable["compute"]["bw"] == [2.0, 2.0, 2.0]
    exact = tmp_path / "exact.yaml"
    exact.write_text(measured.to_yaml(per_model_stage=True))
    (row,) = simulate_rows(capsys, "-a", "interleaved-1f1b", "--pp", "3", "--vpp", "2", "-m", "6", "--cost", str(exact))
    assert row["step_time"] == pytest.approx(result.step_time, rel=1e-12)
    # the portable file serves other algorithms of the same pp
    portable_path = tmp_path / "portable.yaml"
    portable_path.write_text(measured.to_yaml())
    (row,) = simulate_rows(capsys, "-a", "1f1b", "--pp", "3", "-m", "6", "--cost", str(portable_path))
    assert row["step_time"] > 0


def test_overlapped_pairs_give_fb_overlap():
    result = _timeline("dualpipe-v", 4, 8, 2, 1.0, [1.0, 2.0] * 4, 0.5, fb_overlap=0.4)
    measured = measure_costs([result.timeline()])
    assert measured.fb_overlap == pytest.approx(0.4)
    assert measured.backward_input == (1.0, 2.0) * 4
    replayed = simulate(executed_table(result.timeline()),
                        CostModel.from_dict(measured.cost_dict(per_model_stage=True), pp=4, vpp=2))
    assert replayed.step_time == pytest.approx(result.step_time)


def test_warmup_is_skipped_and_memory_is_reported(write_dump):
    slow = _timeline("zb-h1", 2, 4, 1, 3.0, 3.0, 3.0).timeline()
    warm = _timeline("zb-h1", 2, 4, 1, 1.0, [1.0, 2.0], 1.0).timeline()
    jitter = _timeline("zb-h1", 2, 4, 1, 1.0, [1.0, 2.0], 1.5).timeline()
    peaks = [3 * 2**30, 2**30]
    dumped = [replace(t, ranks=tuple(replace(r, peak_memory_bytes=peaks[r.rank] + i) for r in t.ranks))
              for i, t in enumerate([slow, warm, warm, jitter])]
    timelines = load_iterations(write_dump(dumped))
    measured = measure_costs(timelines)
    assert measured.iterations == (1, 2, 3)
    assert measured.forward == (1.0, 1.0) and measured.backward_input == (1.0, 2.0)
    assert measured.backward_weight == (1.0, 1.0), "median over iterations ignores the one jittered step"
    assert measured.peak_memory_bytes == (peaks[0] + 3, peaks[1] + 3)
    text = measured.to_yaml()
    assert f"rank 0: {peaks[0] + 3} (3.000 GiB)" in text and "iterations used: 1, 2, 3" in text
    assert measure_costs(timelines, warmup=0).forward == (1.0, 1.0)
    assert measure_costs(timelines[:1]).notes, "a lone iteration is used, with a note"


def test_mismatched_timelines_are_refused():
    a = _timeline("zb-h1", 2, 4, 1, 1, 1, 1).timeline()
    b = _timeline("zb-h1", 2, 6, 1, 1, 1, 1).timeline()
    with pytest.raises(TableFormatError, match="different shapes"):
        measure_costs([a, b])
    with pytest.raises(TableFormatError, match="no timelines"):
        measure_costs([])
    custom = replace(a, algorithm="my-private-schedule", meta={})
    with pytest.raises(TableFormatError, match="--placement interleaved or v"):
        measure_costs([custom])
