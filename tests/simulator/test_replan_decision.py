"""The re-planning decision on simulated steps (no processes): the choice is the simulator's first of the
running layout, the threshold, the memory limit, the algorithms to choose among and the recommendation of
another layout, and the decision's round trip through the text every rank receives."""

import dataclasses
import re

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.calibration.replan import ReplanSettings
from primuspipe.calibration.replan_decision import Decision, decide, probed
from primuspipe.errors import ConfigError, UnknownAlgorithmError
from primuspipe.simulator import CostModel, simulate

ON = ReplanSettings(enabled=True)


def _steps(running, cost, *, bytes_per_unit=None, start=1000.0, count=2):
    """``count`` simulated steps of ``running`` with its probe; with ``bytes_per_unit``, memory figures as a
    run dump gives them (memory at step start, and peak = start + simulated activations x bytes)."""
    result = simulate(probed(running), cost)
    out = []
    for i in range(count):
        t = result.timeline(i)
        if bytes_per_unit is not None:
            ranks = tuple(dataclasses.replace(rt, peak_memory_bytes=int(start + units * bytes_per_unit))
                          for rt, units in zip(t.ranks, result.peak_activations))
            t = dataclasses.replace(t, ranks=ranks, meta={**t.meta, "ranks": [
                {"rank": rt.rank, "memory_at_start": start} for rt in ranks]})
        out.append(t)
    return out


@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_a_1f1b_run_moves_to_the_fastest_of_its_layout(pp, m):
    running = build_schedule("1f1b", pp, m)
    cost = CostModel.per_stage(pp, f=1.0, b=1.1, w=0.9)
    decision = decide(_steps(running, cost), running, ON)
    times = {c.algorithm: c.step_time for c in decision.ranking}
    assert set(times) >= {"1f1b", "gpipe", "zb-h1", "zb-h2", "zb-auto"} and "zbv" not in times
    assert decision.switch and decision.chosen == decision.ranking[0].algorithm
    assert decision.predicted_step_time == min(times.values()) < decision.running_step_time
    assert decision.table.algorithm == decision.chosen and decision.table.placement == running.placement
    assert decision.running_step_time == pytest.approx(simulate(running, cost).step_time)


def test_threshold_keeps_the_running_table():
    running = build_schedule("1f1b", 2, 4)
    cost = CostModel.per_stage(2, 1, 1, 1)
    decision = decide(_steps(running, cost), running, dataclasses.replace(ON, threshold=0.5))
    assert not decision.switch and decision.table == running and decision.chosen != "1f1b"
    assert "keeping 1f1b" in decision.log_line(5, 0.5)


def test_memory_limit_rules_out_the_tables_that_hold_more():
    running = build_schedule("1f1b", 4, 8)
    cost = CostModel.per_stage(4, 1, 1, 1)
    steps = _steps(running, cost, bytes_per_unit=100.0)
    free = decide(steps, running, ON)
    hungry = {c.algorithm for c in free.ranking if c.peak_activations > 4}
    assert hungry, "some table of the layout holds more than 1F1B's 4 microbatches"
    limited = decide(steps, running, dataclasses.replace(ON, memory_limit_bytes=1000 + 4 * 100))
    for c in limited.ranking:
        assert c.fits == (max(c.peak_memory_bytes) <= 1400), c
    assert limited.chosen not in hungry and limited.ranking[0].fits
    assert all(not c.fits for c in limited.ranking if c.algorithm in hungry)


@pytest.mark.parametrize("room", [4.0, 4.5, 5.0, 6.0])
def test_zb_auto_plans_within_the_limit_the_decision_judges_by(room):
    # the limit in the decision's own count (memory at start + activation units x measured bytes per unit):
    # zb-auto is built within it, so its table fits and is no slower than any fixed table that fits
    running = build_schedule("1f1b", 4, 8)
    cost = CostModel.per_stage(4, 1, 1.2, 0.8)
    steps = _steps(running, cost, bytes_per_unit=100.0)
    decision = decide(steps, running, dataclasses.replace(ON, memory_limit_bytes=1000 + room * 100))
    ranked = {c.algorithm: c for c in decision.ranking}
    assert ranked["zb-auto"].fits and max(ranked["zb-auto"].peak_memory_bytes) <= 1000 + room * 100
    assert ranked["zb-auto"].step_time <= min(c.step_time for c in decision.ranking if c.fits) + 1e-9


def test_algorithms_to_choose_among_and_the_recommendation():
    running = build_schedule("1f1b", 4, 8)
    cost = CostModel.per_stage(4, 1, 1, 1)
    decision = decide(_steps(running, cost), running, dataclasses.replace(ON, algorithms=("gpipe",), threshold=0.05))
    assert [c.algorithm for c in decision.ranking] == ["gpipe"]
    assert decision.switch and decision.chosen == "gpipe", "leaving an algorithm not among them switches anyway"
    rec = decision.recommendation
    assert rec is not None and rec.placement == "v" and rec.step_time < decision.predicted_step_time
    assert f"recommended: {rec.algorithm} (v placement, vpp=2)" in decision.log_line(5, 0.05)


def test_the_decision_goes_through_text_unchanged():
    running = build_schedule("zbv", 2, 4)
    cost = CostModel.per_stage(2, 1, 1.2, 0.8).for_shape(2, 2)
    decision = decide(_steps(running, cost), running, ON)
    assert {c.algorithm for c in decision.ranking} >= {"zbv", "v-half", "v-min", "dualpipe-v"}
    again = Decision.from_dict(decision.to_dict(), decision.table)
    assert again == decision


@pytest.mark.parametrize("names, error, words", [
    ("zb-h1,,zb-h2", ConfigError, "empty or non-text name"),
    (" ", ConfigError, "empty or non-text name"),
    (("zb-h1", 3), ConfigError, "empty or non-text name"),
    ("zb-h3", UnknownAlgorithmError, "auto_replan algorithms: no algorithm named 'zb-h3'; registered: 1f1b"),
])
def test_algorithms_to_choose_among_are_refused_when_not_algorithm_names(names, error, words):
    with pytest.raises(error, match=re.escape(words)):
        ReplanSettings(enabled=True, algorithms=names)
    assert ReplanSettings(algorithms=" zb-h1, zb-h2 ").algorithms == ("zb-h1", "zb-h2")


@pytest.mark.parametrize("env, words", [
    ({"PRIMUSPIPE_AUTO_REPLAN_STEPS": "0"}, "PRIMUSPIPE_AUTO_REPLAN_STEPS must be >= 1"),
    ({"PRIMUSPIPE_AUTO_REPLAN_THRESHOLD": "1.5"}, "PRIMUSPIPE_AUTO_REPLAN_THRESHOLD (a share, e.g. 0.03) must be <= 1"),
    ({"PRIMUSPIPE_AUTO_REPLAN_THRESHOLD": "nan"}, "PRIMUSPIPE_AUTO_REPLAN_THRESHOLD (a share, e.g. 0.03) must be a number"),
    ({"PRIMUSPIPE_AUTO_REPLAN_MEMORY_LIMIT": "0"}, "PRIMUSPIPE_AUTO_REPLAN_MEMORY_LIMIT (bytes) must be > 0"),
])
def test_a_bad_variable_is_named_in_the_one_line(env, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        ReplanSettings.from_env({"PRIMUSPIPE_AUTO_REPLAN": "1", **env})
