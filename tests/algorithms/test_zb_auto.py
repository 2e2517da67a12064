"""zb-auto: never slower than the best fixed algorithm that fits the memory limit (bench/bench_zb_auto.py's
sweep of 24 cost cases; "best fixed" from build_schedule and the simulator alone), on every placement;
deterministic; proven optimal where the MILP is small; its report is its own value."""

import sys
from pathlib import Path

import pytest

from primuspipe.algorithms import ScheduleRequest, get_algorithm
from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, ScheduleShapeError
from primuspipe.ir.activations import peak_in_flight
from primuspipe.ir.cost_model import CostModel
from primuspipe.search.zb_auto import zb_auto_search
from primuspipe.simulator import simulate

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from bench_zb_auto import CASES, best_fixed, model  # noqa: E402  the sweep and "best fixed", from build_schedule alone


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_never_slower_than_the_best_fixed_algorithm_within_the_limit(case):
    pp, m, f, b, w, p2p, limit = CASES[case]
    cost = model(pp, f, b, w, p2p)
    table = build_schedule("zb-auto", pp, m, cost=cost, memory_limit=limit)
    step = simulate(table, cost.for_shape(pp, table.vpp)).step_time
    if limit is not None:
        assert max(peak_in_flight(table)) <= limit + 1e-9
    fixed = best_fixed(pp, m, cost, limit)
    assert fixed is not None, "each case has a fixed algorithm that fits, so the comparison is not vacuous"
    assert step <= fixed[0] + 1e-9, (step, fixed)
    assert table.algorithm == "zb-auto"


@pytest.mark.parametrize("pp, vpp, m, f, b, w", [(2, 1, 4, 1, 2, 1), (3, 1, 4, 1, 1, 1), (2, 2, 3, 1, 1.5, 0.5)])
def test_small_cases_are_proven_optimal_by_the_milp(pp, vpp, m, f, b, w):
    req = ScheduleRequest(pp, vpp, m, CostModel.per_stage(pp, f, b, w), memory_limit=pp)
    table, report = zb_auto_search(req)
    assert report.optimal and report.gap == 0 and report.lower_bound == pytest.approx(report.step_time)
    assert report.step_time == simulate(table, req.cost_model(table.vpp)).step_time
    assert table.algorithm == "zb-auto", "the search report is its own value, not part of the table's name"


def test_searches_every_placement_unless_pinned():
    cost = CostModel.per_stage(4, 1, 1, 1)
    _, report = zb_auto_search(ScheduleRequest(4, None, 8, cost), use_milp=False)
    assert report.searched == ("interleaved vpp=1", "interleaved vpp=2", "v")
    _, report = zb_auto_search(ScheduleRequest(4, 2, 8, cost), use_milp=False)
    assert report.searched == ("interleaved vpp=2", "v")
    table, report = zb_auto_search(ScheduleRequest(4, None, 8, cost), placement="interleaved", use_milp=False)
    assert report.searched == ("interleaved vpp=1", "interleaved vpp=2") and table.placement.name == "interleaved"
    table = build_schedule("zb-auto", 4, 8, cost=cost, placement="v", use_milp=False)
    assert table.placement.name == "v" and table.vpp == 2
    with pytest.raises(ScheduleShapeError, match="V placement needs vpp = 2"):
        build_schedule("zb-auto", 4, 8, 1, cost=cost, placement="v")
    with pytest.raises(ConfigError, match="placement must be"):
        build_schedule("zb-auto", 4, 8, cost=cost, placement="w")


def test_the_same_request_gives_the_same_table():
    """Bounded by work, not by the clock (tests/algorithms/test_zb_auto_determinism.py runs it in two
    processes, one of them under load)."""
    req = ScheduleRequest(4, None, 8, CostModel.per_stage(4, 1, 1.5, 0.5), memory_limit=3)
    first, report = zb_auto_search(req)
    again, same = zb_auto_search(req)
    assert first.to_json() == again.to_json() and report == same


def test_reports_progress_and_refuses_an_impossible_limit():
    seen = []
    req = ScheduleRequest(3, 1, 6, None, memory_limit=None)
    zb_auto_search(req, progress=lambda line, done: seen.append((line, done)))
    assert seen and all(0 <= done <= 1 for _, done in seen) and "step" in seen[-1][0]
    with pytest.raises(ScheduleShapeError, match="raise the memory limit"):
        zb_auto_search(ScheduleRequest(3, 1, 6, None, memory_limit=0.5))
    with pytest.raises(ConfigError, match="must be >= 0"):
        zb_auto_search(req, fills=-1)


def test_p2p_time_comes_from_the_cost_model_only():
    with pytest.raises(ConfigError, match="p2p_time.*cost model"):
        build_schedule("zb-auto", 4, 8, p2p_time=0.1)
    with pytest.raises(ConfigError, match="p2p_time.*cost model"):
        build_schedule("zbv", 4, 8, p2p_time=0.1)


def test_registered_with_split_backward_and_work_bounds():
    info = get_algorithm("zb-auto")
    options = {p.name for p in info.options()}
    assert info.split_backward and info.placement == "any"
    assert {"placement", "fills", "milp_nodes", "milp_iterations", "use_milp"} <= options
    assert "time_budget_s" not in options and "p2p_time" not in options
