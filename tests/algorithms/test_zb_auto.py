"""zb-auto: never slower than the best fixed algorithm that fits the memory limit, never over it."""

import pytest

from primuspipe.algorithms import ScheduleRequest, get_algorithm, list_algorithms
from primuspipe.search.zb_auto import zb_auto_search
from primuspipe.ir.costs import ComputeCosts
from primuspipe.errors import ScheduleShapeError
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, Link, P2PCost, simulate
from primuspipe.ir.activations import peak_in_flight

CASES = {
    # name: (pp, vpp, m, f, b, w, p2p, memory limit)
    "uniform, 1F1B memory": (4, 1, 8, 1, 1, 1, 0.0, 4),
    "B heavy, V-half memory": (6, 2, 12, 1, 2, 1, 0.0, 4),
    "slow last stage, P2P, no limit": (4, 1, 12, [1, 1, 1, 2], [1, 1, 1, 2], [0.5, 0.5, 0.5, 1], 0.1, None),
    "V, W light, V-min memory": (4, 2, 8, 1, 1.5, 0.5, 0.0, 2),
    "V, heterogeneous, P2P": (3, 2, 6, [1, 2, 1, 1, 1, 2], [2, 3, 2, 2, 2, 3], [1, 1, 0.5, 0.5, 1, 1], 0.2, 3),
}


def _model(costs: ComputeCosts, p2p: float) -> CostModel:
    return CostModel(costs, p2p=P2PCost(intra_node=Link(p2p), inter_node=Link(p2p)))


def _best_fixed(pp, vpp, m, costs, p2p, limit):
    best = None
    for info in list_algorithms():
        if info.name == "zb-auto" or (info.vpp or vpp) != vpp:
            continue
        try:
            table = build_schedule(info.name, pp, m, vpp, costs=costs)
        except ScheduleShapeError:
            continue
        if limit is None or max(peak_in_flight(table)) <= limit:
            step = simulate(table, _model(costs, p2p)).step_time
            best = min(best or (step, info.name), (step, info.name))
    return best


@pytest.mark.parametrize("case", sorted(CASES))
def test_at_least_as_fast_as_the_best_fixed_algorithm_within_the_limit(case):
    pp, vpp, m, f, b, w, p2p, limit = CASES[case]
    costs = ComputeCosts.per_stage(pp * vpp, f, b, w)
    table = build_schedule("zb-auto", pp, m, vpp, costs=costs, memory_limit=limit, time_budget_s=1.0, p2p_time=p2p)
    result = simulate(table, _model(costs, p2p))
    if limit is not None:
        assert max(peak_in_flight(table)) <= limit
    fixed = _best_fixed(pp, vpp, m, costs, p2p, limit)
    assert fixed is not None, "each case has a fixed algorithm that fits, so the comparison is not vacuous"
    assert result.step_time <= fixed[0] + 1e-9, (result.step_time, fixed)
    assert table.algorithm.startswith("zb-auto (")


def test_tiny_case_is_proven_optimal_by_the_milp():
    req = ScheduleRequest(2, 1, 4, ComputeCosts.per_stage(2, 1, 2, 1), memory_limit=2)
    table, report = zb_auto_search(req, time_budget_s=5)
    assert report.optimal and report.gap == 0 and report.lower_bound == report.step_time
    assert report.step_time == simulate(table, CostModel(req.costs)).step_time
    assert "optimal" in table.algorithm


def test_beats_every_fixed_algorithm_where_none_fits_well():
    """Below 1F1B's memory only the searched schedules fit; the MILP still bounds them."""
    req = ScheduleRequest(4, 1, 8, ComputeCosts.per_stage(4, 1, 1, 1), memory_limit=2)
    table, report = zb_auto_search(req, time_budget_s=2)
    assert max(peak_in_flight(table)) <= 2
    assert report.method in ("heuristic", "milp") and report.lower_bound is not None
    assert report.lower_bound <= report.step_time


def test_reports_progress_and_refuses_an_impossible_limit():
    seen = []
    req = ScheduleRequest(3, 1, 6, None, memory_limit=None)
    zb_auto_search(req, time_budget_s=0.5, progress=lambda line, done: seen.append((line, done)))
    assert seen and all(0 <= done <= 1 for _, done in seen) and "step" in seen[-1][0]
    with pytest.raises(ScheduleShapeError, match="raise the memory limit"):
        zb_auto_search(ScheduleRequest(3, 1, 6, None, memory_limit=0.5), time_budget_s=0.5)


def test_registered_with_split_backward():
    info = get_algorithm("zb-auto")
    assert info.split_backward and {"time_budget_s", "p2p_time"} <= {p.name for p in info.options()}
