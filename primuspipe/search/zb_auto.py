"""``zb-auto``: the fastest schedule it can find for given per-stage costs and a memory limit.

The search, within ``time_budget_s``:

1. every fixed algorithm registered for this vpp (1F1B, ZB-H1/H2, ZBV, V-half, V-min, DualPipe-V, ...)
   whose table fits the memory limit;
2. the greedy list scheduler (the ZB paper's heuristic: B before F, W's into the gaps) over a grid of
   per-rank activation caps within the limit, for the interleaved and (vpp = 2) the V placement;
3. if the order MILP (:mod:`primuspipe.search.zb_milp`) is small enough and time is left, HiGHS
   improves on the best of 1-2, seeded with it, and reports a lower bound.

Every candidate is timed by the simulator with the same costs, so the answer is the best *simulated*
step time; the report says which method produced it and, when the MILP ran, the optimality gap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from itertools import product
from typing import NamedTuple

from primuspipe.algorithms.list_scheduler import FillPolicy, list_schedule, unit_costs
from primuspipe.algorithms.registry import ScheduleRequest, list_algorithms, register
from primuspipe.search.zb_milp import count_binaries, solve_order_milp, table_starts
from primuspipe.passes.communication import add_communication
from primuspipe.ir.costs import ComputeCosts
from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.placement import Placement
from primuspipe.simulator import CostModel, Link, P2PCost, SimulationResult, simulate
from primuspipe.ir.table import ScheduleTable
from primuspipe.ir.activations import peak_in_flight
from primuspipe.passes.validation import validate

logger = logging.getLogger(__name__)

MILP_MAX_BINARIES = 3000
"""Above this many order binaries HiGHS rarely improves on the heuristic within seconds."""

MILP_MIN_TIME_S = 0.05
"""Below this much time left the MILP is not started."""

Progress = Callable[[str, float], None]
"""Called with a status line and the fraction of the time budget spent."""


@dataclass(frozen=True)
class ZbAutoReport:
    method: str
    """``"fixed"``, ``"heuristic"`` or ``"milp"``: what produced the returned table."""
    source: str
    """The candidate: an algorithm name, a list-scheduler policy, or the MILP."""
    step_time: float
    """Simulated step time of the returned table."""
    peak_in_flight: float
    """Its largest per-rank activation peak (1F1B-stage microbatches)."""
    lower_bound: float | None
    """A proven lower bound on the step time (from the MILP), if it ran."""
    optimal: bool
    candidates: int
    """Candidate tables simulated."""
    elapsed_s: float

    @property
    def gap(self) -> float | None:
        """Relative optimality gap ``(step - bound) / step``, when a bound is known."""
        if self.lower_bound is None or self.step_time <= 0:
            return None
        return max(self.step_time - self.lower_bound, 0.0) / self.step_time

    @property
    def summary(self) -> str:
        gap = "gap unknown" if self.gap is None else ("optimal" if self.optimal else f"gap {self.gap:.1%}")
        return f"{self.method}: {self.source}, step {self.step_time:g}, {gap}"


class _Candidate(NamedTuple):
    """The best table so far, its simulated step time and peak (compared in that order), and its source."""

    step_time: float
    peak: float
    method: str
    source: str
    table: ScheduleTable
    result: SimulationResult


def _cost_model(costs: ComputeCosts, p2p_time: float) -> CostModel:
    link = Link(latency=p2p_time)
    return CostModel(costs, p2p=P2PCost(intra_node=link, inter_node=link))


def _fixed_candidates(req: ScheduleRequest) -> Iterator[tuple[str, ScheduleTable]]:
    for info in list_algorithms():
        if info.name == "zb-auto" or (info.vpp is not None and info.vpp != req.vpp):
            continue
        try:
            yield info.name, info.build(req)
        except ScheduleShapeError:
            continue


def _policies(req: ScheduleRequest, cap_limit: int) -> Iterator[tuple[str, Placement, FillPolicy]]:
    """List-scheduler policies to try, most memory first (more memory rarely hurts the step time)."""
    p, v = req.pp, req.vpp
    placements = [Placement.interleaved(p, v)] + ([Placement.vshape(p)] if v == 2 else [])
    reserves = (0,) if v == 1 else (1, 2, 3)
    for placement, top, slope in product(placements, range(cap_limit, 0, -1), (0, 1, 2)):
        caps = tuple(max(top - slope * r, 1) for r in range(p))
        if slope and len(set(caps)) == 1:
            continue  # the caps of slope 0
        for reserve, first in product(reserves, (True, False)):
            if reserve < min(caps):
                name = f"list-schedule {placement.name} caps={top}-{slope}r reserve={reserve} {'B' if first else 'F'}-first"
                yield name, placement, FillPolicy(caps, reserve, first)


def zb_auto_search(
    req: ScheduleRequest,
    *,
    time_budget_s: float = 10.0,
    p2p_time: float = 0.0,
    use_milp: bool = True,
    progress: Progress | None = None,
    check: bool = True,
) -> tuple[ScheduleTable, ZbAutoReport]:
    """Search as described in the module doc; returns the best table and how it was found.

    ``check=False`` skips validating the answer (for callers such as ``build_schedule`` that validate).

    >>> req = ScheduleRequest(2, 1, 4, ComputeCosts.per_stage(2, 1, 1, 1), memory_limit=2)
    >>> table, report = zb_auto_search(req, time_budget_s=5)
    >>> report.step_time, report.optimal
    (13.0, True)
    """
    began = time.monotonic()
    deadline = began + time_budget_s
    costs = req.costs or unit_costs(req.pp * req.vpp)
    model = _cost_model(costs, p2p_time)
    limit = req.memory_limit
    cap_limit = 2 * req.pp * req.vpp if limit is None else int(limit * req.vpp + 1e-9)
    best: _Candidate | None = None
    tried = 0

    @cache
    def milp_size(placement: Placement) -> int | None:
        return count_binaries(placement, req.microbatches, MILP_MAX_BINARIES) if use_milp else None

    def report(line: str) -> None:
        logger.info("zb-auto: %s", line)
        if progress is not None:
            progress(line, min((time.monotonic() - began) / time_budget_s, 1.0))

    def consider(method: str, source: str, table: ScheduleTable) -> None:
        nonlocal best, tried
        peak = max(peak_in_flight(table))
        if limit is not None and peak > limit + 1e-9:
            return
        tried += 1
        result = simulate(table, model)
        if best is None or (result.step_time, peak) < (best.step_time, best.peak):
            best = _Candidate(result.step_time, peak, method, source, table, result)
            report(f"best so far {result.step_time:g} from {source} (peak {peak:g})")

    # 1. the fixed algorithms
    for name, table in _fixed_candidates(replace(req, costs=costs)):
        consider("fixed", name, table)
        if best is not None and time.monotonic() > deadline:
            break
    # 2. the list scheduler over a grid of caps; stop at the budget's first half if the MILP may run
    may_run_milp = milp_size(Placement.interleaved(req.pp, req.vpp)) is not None
    heuristic_deadline = began + time_budget_s * (0.5 if may_run_milp else 1.0)
    for source, placement, policy in _policies(req, cap_limit):
        if time.monotonic() > heuristic_deadline:
            report("heuristic search stopped at its share of the time budget")
            break
        try:
            timed = list_schedule(placement, req.microbatches, costs, policy, p2p_time=p2p_time, algorithm="zb-auto")
        except ScheduleShapeError:
            continue
        consider("heuristic", source, ScheduleTable.build(placement, req.microbatches, timed.rows, "zb-auto"))
    if best is None:
        raise ScheduleShapeError(
            f"zb-auto: no schedule of pp={req.pp}, vpp={req.vpp}, {req.microbatches} microbatches holds at most "
            f"{limit:g} microbatches of activations per rank; raise the memory limit"
        )
    # 3. the exact MILP on the best table's placement, seeded with its simulated start times
    lower_bound, optimal = None, False
    placement = best.table.placement
    size = milp_size(placement)
    if size is not None and deadline - time.monotonic() > MILP_MIN_TIME_S:
        report(f"MILP over {size} order binaries")
        incumbent = table_starts(best.result.table, [r.starts for r in best.result.ranks])
        milp = solve_order_milp(placement, req.microbatches, costs, p2p_time=p2p_time, cap=cap_limit if limit is not None else None,
                                upper_bound=best.step_time, time_limit_s=deadline - time.monotonic(), incumbent=incumbent)
        lower_bound = milp.lower_bound
        if milp.rows is not None:
            consider("milp", "order MILP (HiGHS)", ScheduleTable.build(placement, req.microbatches, milp.rows, "zb-auto"))
        optimal = milp.optimal and best.step_time <= milp.lower_bound + 1e-6
        report(f"MILP bound {lower_bound:g}, {'optimal' if optimal else 'not proven optimal'}")
    final = ZbAutoReport(best.method, best.source, best.step_time, best.peak, lower_bound, optimal, tried,
                         time.monotonic() - began)
    report(final.summary)
    if check:
        validate(add_communication(best.table))
    return replace(best.table, algorithm=f"zb-auto ({final.summary})"), final


@register("zb-auto", split_backward=True)
def zb_auto(
    req: ScheduleRequest, *, time_budget_s: float = 10.0, p2p_time: float = 0.0, use_milp: bool = True
) -> ScheduleTable:
    """zb-auto: searches (fixed algorithms, greedy fill, order MILP) for the fastest schedule under a memory limit."""
    return zb_auto_search(req, time_budget_s=time_budget_s, p2p_time=p2p_time, use_milp=use_milp, check=False)[0]
