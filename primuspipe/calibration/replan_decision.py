"""Pick a better schedule from a few measured steps of the running one: the decision of in-flight re-planning.

A run measures its first steps (:mod:`primuspipe.backends.replanning` drives it); this module turns
them into a choice, with no torch and no process group, so the same decision is tested on simulated
timelines and taken on rank 0 of a live run:

* :func:`measure_costs` calibrates every term of the cost model from the steps, which ran the running
  table with a short split-backward probe (:func:`probed`, :mod:`primuspipe.passes.split_probe`), so B and W
  are measured apart from the fused BW;
* every registered algorithm whose table for the shape has the running layout
  (:mod:`~primuspipe.calibration.replan_candidates`) is built under the measured costs (cost-aware ones plan
  with them) and simulated; a table whose predicted peak memory exceeds the limit is left out (zb-auto plans
  within the limit as the same prediction counts it:
  :meth:`~primuspipe.calibration.replan_memory.MemoryPrediction.unit_limit`);
* the fastest is chosen when it beats the running table's own prediction by more than the threshold
  (:class:`~primuspipe.calibration.replan.ReplanSettings`);
* algorithms of other layouts are simulated from the per-1F1B-stage costs (the portable cost file),
  and the best is *recommended* when it would beat the choice by the threshold: switching layout
  rebuilds the model chunks, which a restart from a checkpoint does (docs/replanning.md).

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.simulator import CostModel, simulate
>>> running = build_schedule("1f1b", pp=2, microbatches=4)
>>> cost = CostModel.per_stage(2, f=1, b=1, w=1)
>>> steps = [simulate(probed(running), cost).timeline(i) for i in range(2)]
>>> decision = decide(steps, running, ReplanSettings(enabled=True))
>>> decision.chosen, decision.switch, decision.predicted_step_time, decision.running_step_time
('zb-auto', True, 13.0, 15.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from primuspipe.calibration.measure import measure_costs
from primuspipe.calibration.replan import ReplanSettings
from primuspipe.calibration.replan_candidates import Candidate, buildable, cut_for, priced
from primuspipe.calibration.replan_memory import MemoryPrediction
from primuspipe.calibration.replay import run_table
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.timeline import Timeline
from primuspipe.passes.communication import add_communication
from primuspipe.passes.split_probe import split_backward_probe
from primuspipe.passes.validation import validate
from primuspipe.simulator import simulate


def probed(table: ScheduleTable, count: int = 1) -> ScheduleTable:
    """What a measured step runs: ``table`` with ``count`` backwards per chunk split by the probe, where it
    has fused backwards (a split-backward table times B and W itself)."""
    if count == 0 or not any(n.kind is NodeKind.BW for row in table.ranks for n in row):
        return table
    return validate(add_communication(split_backward_probe(table.compute_only(),
                                                           min(count, table.microbatches))))


@dataclass(frozen=True)
class Decision:
    """What rank 0 decided from the measured steps; every rank gets it (and ``table``) by broadcast."""

    running: str
    chosen: str
    switch: bool
    table: ScheduleTable
    """The table to run from now on: the chosen one when switching, else the running one."""
    predicted_step_time: float
    """The simulated step of ``table`` under the measured costs."""
    running_step_time: float
    """The simulated step of the running table (no probe) under the same costs."""
    measured_step_time: float
    """Median step span of the measured (probed) steps."""
    ranking: tuple[Candidate, ...]
    """The running layout's algorithms, fastest first."""
    recommendation: Candidate | None = None
    """An algorithm of another layout predicted faster than the choice by more than the threshold."""
    time_unit: str = "s"
    notes: tuple[str, ...] = field(default_factory=tuple)
    cost: Mapping[str, Any] | None = None
    """The measured cost model (cost-file mapping, per model stage) every candidate was simulated under."""

    @property
    def gain(self) -> float:
        """The predicted share of the running table's step the choice saves."""
        return 1 - self.predicted_step_time / self.running_step_time if self.running_step_time else 0.0

    def log_line(self, step: int, threshold: float) -> str:
        """The one line a run logs with its choice."""
        others = ", ".join(f"{c.algorithm} {c.step_time:.4g}" + ("" if c.fits else " (over memory)")
                           for c in self.ranking)
        head = (f"primuspipe auto-replan at step {step}: switching {self.running} -> {self.chosen}, predicted step "
                f"{self.predicted_step_time:.4g} {self.time_unit} ({self.gain:+.1%} vs {self.running}'s predicted "
                f"{self.running_step_time:.4g}; threshold {threshold:.1%})" if self.switch else
                f"primuspipe auto-replan at step {step}: keeping {self.running}, predicted step "
                f"{self.predicted_step_time:.4g} {self.time_unit} (best of its layout: {self.chosen}, gain "
                f"{1 - self.ranking[0].step_time / self.running_step_time:+.1%}, threshold {threshold:.1%})")
        tail = f"; measured {self.measured_step_time:.4g} {self.time_unit} (with probe); ranking: {others}"
        if (r := self.recommendation) is not None:
            tail += (f"; recommended: {r.algorithm} ({r.placement} placement, vpp={r.vpp}) predicted "
                     f"{r.step_time:.4g} {self.time_unit} -- it needs other model chunks: save a checkpoint and "
                     f"restart with pp_algorithm={r.algorithm} (checkpoints load under any schedule)")
        return head + tail

    def to_dict(self) -> dict[str, Any]:
        return {"running": self.running, "chosen": self.chosen, "switch": self.switch, "gain": self.gain,
                "predicted_step_time_s": self.predicted_step_time, "running_predicted_step_time_s":
                self.running_step_time, "measured_step_time_s": self.measured_step_time,
                "ranking": [c.to_dict() for c in self.ranking],
                "recommendation": None if self.recommendation is None else self.recommendation.to_dict(),
                "time_unit": self.time_unit, "notes": list(self.notes), "cost_model": self.cost}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], table: ScheduleTable) -> Decision:
        """The decision :meth:`to_dict` wrote, with the ``table`` it chose (sent beside it as text)."""
        recommendation = d["recommendation"]
        return cls(d["running"], d["chosen"], d["switch"], table, d["predicted_step_time_s"],
                   d["running_predicted_step_time_s"], d["measured_step_time_s"],
                   tuple(map(Candidate.from_dict, d["ranking"])),
                   None if recommendation is None else Candidate.from_dict(recommendation), d["time_unit"],
                   tuple(d["notes"]), d["cost_model"])


def decide(timelines: Sequence[Timeline], running: ScheduleTable, settings: ReplanSettings, *,
           memory_capacity_bytes: float | None = None) -> Decision:
    """The decision from merged timelines of measured steps of ``running`` (with its probe, as
    :func:`probed` makes it). ``memory_capacity_bytes``: the device's memory, the limit when the
    settings give none."""
    measured = replace(measure_costs(timelines, warmup=0), step_gap=None)
    pp, m, vpp = running.pp, running.microbatches, running.vpp
    cost = CostModel.from_dict(measured.cost_dict(per_model_stage=True), pp=pp, vpp=vpp)
    portable = CostModel.from_dict(measured.cost_dict(), pp=pp, vpp=1)  # per 1F1B stage: any vpp
    limit = settings.memory_limit_bytes if settings.memory_limit_bytes is not None else memory_capacity_bytes
    memory = MemoryPrediction.of(timelines, simulate(_executed(timelines[0], running), cost).peak_activations, limit)
    built = {name: table for name, table in buildable(pp, m, vpp, cost, memory.unit_limit())
             if table.placement == running.placement}
    layout = set(built)
    if settings.algorithms is not None:
        built = {name: table for name, table in built.items() if name in settings.algorithms}
    ranking = [priced(name, table, cost, memory) for name, table in built.items()]
    own = simulate(running, cost).step_time
    # the running table's own order (under any name) ranks first among equals: no switch for nothing
    ranking.sort(key=lambda c: (not c.fits, c.step_time * (1 - 1e-9 * (built[c.algorithm].ranks == running.ranks)),
                                c.peak_activations, c.algorithm))
    best = ranking[0] if ranking and ranking[0].fits else None
    leaving = settings.algorithms is not None and running.algorithm not in settings.algorithms
    switch = best is not None and built[best.algorithm].ranks != running.ranks and (
        leaving or (own > 0 and 1 - best.step_time / own > settings.threshold))
    chosen_table = built[best.algorithm] if switch else running
    predicted = simulate(chosen_table, cost).step_time
    others = [priced(name, table, cut_for(portable, pp, table.vpp), None)
              for name, table in buildable(pp, m, None, portable) if name not in layout]
    faster = sorted((c for c in others if c.step_time < predicted * (1 - settings.threshold)),
                    key=lambda c: (c.step_time, c.peak_activations, c.algorithm))
    notes = list(measured.notes)
    if memory.note:
        notes.append(memory.note)
    return Decision(running.algorithm, best.algorithm if best else running.algorithm, switch, chosen_table, predicted,
                    own, statistics.median(t.step_time for t in timelines), tuple(ranking),
                    faster[0] if faster else None, measured.time_unit, tuple(notes),
                    measured.cost_dict(per_model_stage=True))


def _executed(timeline: Timeline, running: ScheduleTable) -> ScheduleTable:
    """The table the measured steps ran (the running one with its probe), from the timeline's node order."""
    return run_table(timeline, running.placement)


def prediction_error(measured: float, predicted: float) -> float:
    """``(predicted - measured) / measured`` (0 for a zero measurement)."""
    return (predicted - measured) / measured if measured and math.isfinite(measured) else 0.0
