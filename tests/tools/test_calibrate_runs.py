"""Calibrating from several runs: a whole run met a slow moment of the host is left out and named
(primuspipe.calibration.runs), in the library and in ``primuspipe calibrate DUMP_DIR...``."""

import json
import statistics
from dataclasses import replace

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.calibration.measure import measure_costs, measure_runs
from primuspipe.calibration.runs import outliers
from primuspipe.cli import main
from primuspipe.simulator import CostModel, simulate
from primuspipe.tools.pp_vis import load_iterations
from real_runs import train_1f1b

JITTER = (-0.02, 0.0, 0.02)
"""Each run's steady iterations differ by a few percent, as a real run's do."""


def run(scale: float):
    """A 1f1b pp=2 m=4 run (in seconds): a slow warm-up iteration, then three whose every node time is
    ``scale`` times the run's costs (F 1, B 1, W 1 per stage) and the iteration's jitter."""
    def step(factor: float, iteration: int):
        cost = CostModel.per_stage(2, factor, factor, factor, time_unit="s")
        timeline = simulate(build_schedule("1f1b", pp=2, microbatches=4), cost).timeline()
        return replace(timeline, source="run", iteration=iteration)

    return [step(3.0, 0), *(step(scale * (1 + j), i + 1) for i, j in enumerate(JITTER))]


# four runs a percent apart and one that met a host 25 % slower
SCALES = (1.0, 0.99, 1.01, 1.0, 1.25)


def test_a_slow_run_is_left_out_of_the_pooled_calibration_and_said_so():
    runs = [run(s) for s in SCALES]
    measured = measure_runs(runs)
    assert measured.dropped_runs == (4,)
    assert any("left out run 4" in note and "+2" in note for note in measured.notes)
    # the costs are the four other runs' (median of their iterations), not shifted towards the slow one
    truth = statistics.median(s * (1 + j) for s in SCALES[:4] for j in JITTER)
    assert measured.forward == pytest.approx((truth, truth), rel=1e-9)
    # what the guard prevents: every run's steady iterations pooled as one move F by a share of the slow run
    pooled = measure_costs([t for r in runs for t in r[1:]], warmup=0)
    assert pooled.dropped_runs == () and pooled.forward[0] > truth * 1.009


def test_runs_that_agree_or_are_too_few_are_all_kept():
    close = [run(s) for s in (1.0, 0.99, 1.01, 1.0, 1.04)]  # 4 % off: within the band's floor
    assert measure_runs(close).dropped_runs == ()
    two = [run(1.0), run(1.25)]  # with two runs neither is the odd one
    assert measure_runs(two).dropped_runs == ()
    assert outliers([1.0, 1.0, 1.0]) == () and outliers([1.0, 1.0, 2.0]) == (2,)
    assert outliers([100.0, 50.0, 101.0, 99.0]) == (1,)  # a run on a freer host is as odd as a slower one


def test_calibrate_pools_several_dumps_and_names_the_run_it_left_out(write_dump, tmp_path, capsys):
    dumps = [str(write_dump(run(s), name=f"run{i}")) for i, s in enumerate(SCALES)]
    cost = tmp_path / "measured.yaml"
    assert main(["calibrate", *dumps, "-o", str(cost), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dropped_runs"] == [4] and len(report["run_steps"]) == 5
    assert report["run_steps"][4] == pytest.approx(1.25 * statistics.median(report["run_steps"][:4]), rel=0.02)
    assert any("left out run 4" in note for note in report["notes"])
    assert "left out run 4" in cost.read_text()  # the file's header says it too
    assert len(report["iterations"]) == 4 * len(JITTER)  # each kept run's warm-up skipped, the rest pooled
    truth = statistics.median(s * (1 + j) for s in SCALES[:4] for j in JITTER)
    assert report["cost_model"]["compute"]["f"] == pytest.approx([truth, truth], rel=1e-9)
    assert [len(load_iterations(d)) for d in dumps] == [1 + len(JITTER)] * len(SCALES)


def _on_host(timeline, factor: float):
    """``timeline`` as a host ``factor`` times slower would have run it: every reading stretched. CPU
    stamps are dropped (wall clock only): the guard judges steps, and the CPU-sharing fit of a loaded test
    host is not what this test is about."""
    def stretch(pair):
        return None if pair is None else tuple(x if x is None else x * factor for x in pair)

    ranks = tuple(replace(rt, events=tuple(replace(e, start=e.start * factor, end=e.end * factor, cpu=None,
                                                   layers=stretch(e.layers), ends=stretch(e.ends)) for e in rt.events))
                  for rt in timeline.ranks)
    return replace(timeline, ranks=ranks)


def test_recorded_runs_with_one_slowed_session(tmp_path):
    """A real gloo run's dump, calibrated as three sessions of it and a fourth that is the same run met by a
    host 30 % slower (the bench's left-out session was 40 % slower): the fourth is left out and named, and
    the costs are the real run's own; pooled in, it moves them. (The same run three times keeps the test
    deterministic: a loaded test host makes separate tiny runs differ by more than any band.)"""
    train_1f1b(tmp_path / "pp_data", steps=8)
    real = [_on_host(t, 1.0) for t in load_iterations(tmp_path / "pp_data")[1:]]
    slowed = [_on_host(t, 1.3) for t in real]
    measured = measure_runs([real, real, real, slowed], warmup=0)
    assert measured.dropped_runs == (3,) and any("left out run 3" in note and "+30" in note for note in measured.notes)
    own = measure_costs(real, warmup=0)
    assert (measured.forward, measured.fused_backward) == (own.forward, own.fused_backward)
    pooled = measure_costs([*real, *real, *real, *slowed], warmup=0)  # what the guard prevents
    assert pooled.forward != own.forward
    assert measure_runs([real, real, real, [_on_host(t, 1.04) for t in real]], warmup=0).dropped_runs == ()
