"""How well a cost model reproduces a run: the run's own node order replayed under it, rank by rank.

``primuspipe calibrate --json`` reports this for the model it just measured, so a user sees at once
whether the simulator can be trusted on this machine before ranking other algorithms with it. A rank's
*finish* is when its last node ended, counted from the step's start (the earliest node start over all
ranks); the run's figure is the median over the iterations measured, as the costs are.

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.simulator import CostModel, simulate
>>> cost = CostModel.per_stage(2, 1, 1, 1)
>>> report = replay_accuracy([simulate(build_schedule("1f1b", pp=2, microbatches=4), cost).timeline()], cost)
>>> report.step_time_error, [r.error for r in report.ranks]
(0.0, [0.0, 0.0])
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from primuspipe.calibration.replay import executed_table, placement_of
from primuspipe.errors import TableFormatError
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.placement import Placement
from primuspipe.io.timeline import Timeline, idle_share
from primuspipe.simulator import simulate


@dataclass(frozen=True)
class Figure:
    """One quantity of the run beside its replay; ``error`` is ``(simulated - measured) / measured``."""

    measured: float
    simulated: float

    @property
    def error(self) -> float:
        return (self.simulated - self.measured) / self.measured if self.measured else 0.0

    def to_dict(self) -> dict:
        return {"measured": self.measured, "simulated": self.simulated, "error": self.error}


@dataclass(frozen=True)
class RankFigure(Figure):
    rank: int = 0

    def to_dict(self) -> dict:
        return {"rank": self.rank, **super().to_dict()}


@dataclass(frozen=True)
class ReplayAccuracy:
    """The run's step, bubble and per-rank finish beside the simulation of its own table."""

    step_time: Figure
    bubble_rate: Figure
    """The worst rank's ``(step - busy) / step``."""
    ranks: tuple[RankFigure, ...]
    """Per rank, its finish (see the module docstring)."""

    @property
    def step_time_error(self) -> float:
        """The largest relative error of a rank's finish (the step's own error is the last rank's)."""
        return max((abs(r.error) for r in self.ranks), default=0.0)

    def to_dict(self) -> dict:
        return {"step_time_error": self.step_time_error, "per_rank": [r.to_dict() for r in self.ranks],
                "step_time": self.step_time.to_dict(), "bubble_rate": self.bubble_rate.to_dict()}


def replay_accuracy(timelines: Sequence[Timeline], cost: CostModel,
                    placement: Placement | None = None) -> ReplayAccuracy:
    """Replay the node order of ``timelines`` (iterations of one run; their median is the measured
    figure) under ``cost``, in the timelines' time unit."""
    if not timelines:
        raise TableFormatError("no timelines to compare; dump at least one iteration (dump_pp_data)")
    first = timelines[0]
    placement = placement or placement_of(first)
    result = simulate(executed_table(first, placement), cost)
    simulated = result.timeline()
    pp = first.pp
    ranks = tuple(
        RankFigure(statistics.median(_finishes(t)[rank] for t in timelines), _finishes(simulated)[rank], rank)
        for rank in range(pp)
    )
    return ReplayAccuracy(
        Figure(statistics.median(t.step_time for t in timelines), simulated.step_time),
        Figure(statistics.median(_bubble_rate(t) for t in timelines), _bubble_rate(simulated)),
        ranks,
    )


def _finishes(timeline: Timeline) -> list[float]:
    """Per rank (by rank number), when its last node ended, from the step's start."""
    origin = min(e.start for rt in timeline.ranks for e in rt.events)
    out = [0.0] * timeline.pp
    for rt in timeline.ranks:
        out[rt.rank] = max(e.end for e in rt.events) - origin
    return out


def _bubble_rate(timeline: Timeline) -> float:
    step = timeline.step_time
    return max(idle_share(step, sum(e.end - e.start for e in rt.events if e.node.kind.is_compute))
               for rt in timeline.ranks)
