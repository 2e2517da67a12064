"""The competition among an algorithm's candidate constructions, and the record of its outcome.

The zero-bubble algorithms do not trust one construction: under uneven costs or P2P time a different
warm-up tie-break, W placement or building block can be faster. Each builds its candidates -- the
list scheduler's fills (:mod:`~primuspipe.algorithms.list_scheduler`) under several policies or fixed
F/B orders, plus ready-made tables -- and the one the simulator times fastest under the planning costs
wins. Ties keep the earlier candidate, so algorithms list their preferred (lower-memory) one first.

The winner carries a :class:`~primuspipe.ir.table.Construction`: which candidate it is, its simulated
step, how many competed, and -- where the algorithm writes out its paper's schedule (the ZB-H1 and
ZB-H2 patterns, ZBV's hand-crafted order, the V-min and V-half blocks) -- that schedule's name and
simulated step. The paper's schedule is named as the choice only when the chosen table is exactly it;
otherwise the record says which candidate beat or differed from it, so ``primuspipe show`` and
``simulate`` tell a reader whether the table is the paper's figure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import NamedTuple

from primuspipe.algorithms.list_scheduler import FillPolicy, FixedOrder, list_schedule
from primuspipe.errors import PrimusPipeError, ScheduleShapeError
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import Construction, ScheduleTable
from primuspipe.simulator import simulate

logger = logging.getLogger(__name__)

_EPS = 1e-9

SHORTLIST = 4
"""How many of the fills with the shortest own makespan the simulator times to pick the answer. With
free P2P the fill's timing is the simulator's (as soon as possible in the given order), so the first
is already the fastest; with P2P time the simulator's rendezvous can reorder close candidates."""


class Filled(NamedTuple):
    """A candidate table, where it comes from (for people), and its step time (the fill's own timing
    before :func:`fastest`, the simulator's after)."""

    table: ScheduleTable
    source: str
    step_time: float


class Paper(NamedTuple):
    """An algorithm's paper schedule as the code writes it out: its name and its compute-only table
    (None where the construction does not apply to the shape)."""

    name: str
    table: ScheduleTable | None


def fill_all(placement: Placement, microbatches: int, cost: CostModel, policies: Sequence[FillPolicy | FixedOrder], *,
             algorithm: str) -> list[Filled]:
    """Every policy's table, timed by the fill (a table two policies give is kept once, as the first's);
    policies that stall are skipped."""
    seen: dict[tuple, int] = {}  # rows -> their place in ``filled`` (a table's rows are hashed once)
    filled: list[Filled] = []
    for policy in policies:
        try:
            result = list_schedule(placement, microbatches, cost, policy, algorithm=algorithm)
        except ScheduleShapeError:
            continue
        if seen.setdefault(result.rows, len(filled)) == len(filled):  # rows no earlier policy gave
            filled.append(Filled(ScheduleTable.build(placement, microbatches, result.rows, algorithm), str(policy),
                                 result.makespan))
    return filled


def shortlist(filled: Sequence[Filled], size: int = SHORTLIST) -> list[Filled]:
    """The ``size`` candidates of least step time (the earlier of equals)."""
    return sorted(filled, key=lambda c: c.step_time)[:size]


class SimulatedSteps:
    """Tables' simulated steps under one cost model, each table simulated once: the paper's schedule can
    also be a candidate (ZBV's hand-crafted order competes as it is)."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self._steps: dict[int, tuple[ScheduleTable, float]] = {}  # by identity; the table is kept alive with it

    def __call__(self, table: ScheduleTable) -> float:
        if (known := self._steps.get(id(table))) is None:
            known = self._steps[id(table)] = table, simulate(table, self.cost).step_time
        return known[1]


def fastest(candidates: Iterable[Filled], steps: SimulatedSteps) -> Filled:
    """The candidate with the shortest step as the simulator times it (the first of equals), so an
    algorithm that builds several keeps the one the user will measure."""
    best: Filled | None = None
    for candidate in candidates:
        step = steps(candidate.table)
        if best is None or step < best.step_time - _EPS:
            best = candidate._replace(step_time=step)
    assert best is not None, "no candidate to choose from"
    return best


def best_fill(
    placement: Placement,
    microbatches: int,
    cost: CostModel,
    policies: Sequence[FillPolicy | FixedOrder],
    *,
    algorithm: str,
    also: Sequence[Filled] = (),
    paper: Paper | None = None,
) -> ScheduleTable:
    """The fastest, as the simulator times it under ``cost``, of the :data:`SHORTLIST` fills with the
    shortest makespan, the ready-made candidates ``also`` and, last, ``paper`` (the algorithm's paper
    schedule), with its :class:`Construction` recorded. Raises ScheduleShapeError if every
    policy stalls and nothing else is given. Ties keep the earlier policy, so list the preferred
    (usually lower-memory) policy first."""
    filled = fill_all(placement, microbatches, cost, policies, algorithm=algorithm)
    if not filled and not also:
        raise ScheduleShapeError(f"{algorithm}: every construction stalls for pp={placement.pp}, {microbatches} "
                                 "microbatches within the memory budget; raise the memory limit")
    steps = SimulatedSteps(cost)
    winner = fastest([*shortlist(filled), *also], steps)
    paper_step = _paper_step(paper, steps)
    if paper_step is not None and paper_step < winner.step_time - _EPS:
        winner = Filled(paper.table, paper.name, paper_step)
    construction = _record(winner, len(filled) + len(also) + (paper_step is not None), paper, paper_step)
    logger.debug("%s: %s", algorithm, construction)
    return replace(winner.table, algorithm=algorithm, construction=construction)


def _paper_step(paper: Paper | None, steps: SimulatedSteps) -> float | None:
    """The paper's schedule's simulated step, or None where the algorithm writes none out or it does
    not run at this shape. The paper's schedule is the last candidate: it wins only when strictly
    faster than every construction before it, so an algorithm is never slower than its paper's figure
    and a tie keeps the (usually lower-memory) fill."""
    if paper is None or paper.table is None:
        return None
    try:
        return steps(paper.table)
    except PrimusPipeError:  # a pattern that deadlocks at this shape is no schedule here
        return None


def _record(winner: Filled, candidates: int, paper: Paper | None, paper_step: float | None) -> Construction:
    """The winner's record; the paper's schedule is named as the choice only if it is the same table."""
    if paper is None:
        return Construction(winner.source, winner.step_time, candidates)
    same = paper.table is not None and paper.table.ranks == winner.table.ranks
    return Construction(paper.name if same else winner.source, winner.step_time, candidates, paper.name,
                        winner.step_time if same else paper_step)
