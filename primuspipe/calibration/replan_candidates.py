"""The tables re-planning chooses among: every registered algorithm's for the running shape, each priced.

A run can switch at a step boundary only to a table of its running layout -- same placement and vpp -- since the
model chunks every rank holds stay valid (1f1b, gpipe, zb-h1, zb-h2, zb-auto; zbv, v-half, v-min, dualpipe-v);
tables of other layouts are priced too, to *recommend* a restart (docs/replanning.md). Which algorithms build
for a shape is asked of the registry here once, for the settings' check
(:meth:`~primuspipe.calibration.replan.ReplanSettings.check_layout`) and the decision
(:mod:`~primuspipe.calibration.replan_decision`) alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from primuspipe.algorithms import list_algorithms
from primuspipe.algorithms.build import build_schedule
from primuspipe.calibration.replan_memory import MemoryPrediction
from primuspipe.errors import PrimusPipeError
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.table import ScheduleTable
from primuspipe.simulator import simulate


@dataclass(frozen=True)
class Candidate:
    """One algorithm's table simulated under the measured costs."""

    algorithm: str
    vpp: int
    placement: str
    step_time: float
    peak_activations: float
    """The most activations a rank holds (simulated, 1F1B-stage microbatches): the tie-break, least first."""
    peak_memory_bytes: tuple[float, ...] | None
    """Predicted per rank; None where the measured steps gave no memory figures."""
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "vpp": self.vpp, "placement": self.placement,
                "predicted_step_time_s": self.step_time, "peak_activations": self.peak_activations,
                "fits_memory": self.fits,
                "predicted_peak_memory_bytes": None if self.peak_memory_bytes is None else list(self.peak_memory_bytes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Candidate:
        peaks = d["predicted_peak_memory_bytes"]
        return cls(d["algorithm"], d["vpp"], d["placement"], d["predicted_step_time_s"], d["peak_activations"],
                   None if peaks is None else tuple(peaks), d["fits_memory"])


def same_layout(table: ScheduleTable) -> list[str]:
    """Registered algorithms whose table for ``table``'s shape has its placement and vpp."""
    return [name for name, built in buildable(table.pp, table.microbatches, table.vpp)
            if built.placement == table.placement and built.vpp == table.vpp]


def buildable(pp: int, m: int, vpp: int | None, cost: CostModel | None = None,
              memory_limit: float | None = None) -> list[tuple[str, ScheduleTable]]:
    """Every registered algorithm's table for the shape (``vpp`` None: each algorithm's own), where it builds."""
    out = []
    for info in list_algorithms():
        if info.alias_of is not None or (vpp is not None and info.vpp is not None and info.vpp != vpp):
            continue
        want = vpp if vpp is not None else info.resolve_vpp(None)
        try:
            out.append((info.name, build_schedule(info.name, pp, m, want, cost=cut_for(cost, pp, want),
                                                  memory_limit=memory_limit)))
        except PrimusPipeError:  # the algorithm refuses this shape
            continue
    return out


def cut_for(cost: CostModel | None, pp: int, vpp: int | None) -> CostModel | None:
    """``cost`` for ``pp * vpp`` stages (it is per 1F1B stage or already for that shape)."""
    return cost if cost is None or vpp is None else cost.for_shape(pp, vpp)


def priced(name: str, table: ScheduleTable, cost: CostModel, memory: MemoryPrediction | None) -> Candidate:
    """``table`` as a candidate: simulated under ``cost``, its memory predicted and held against the limit
    (``memory`` None: not predicted, so it fits)."""
    result = simulate(table, cost)
    peaks = memory.predict(result.peak_activations) if memory is not None else None
    fits = peaks is None or memory.limit is None or max(peaks) <= memory.limit
    return Candidate(name, table.vpp, table.placement.name, result.step_time, max(result.peak_activations), peaks,
                     fits)
