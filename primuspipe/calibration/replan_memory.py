"""The memory a candidate table would take on each rank, predicted from the measured steps.

Per rank: the memory at step start (``meta.ranks[].memory_at_start``) plus the simulator's peak activations times
the bytes one activation unit took in the measured steps ((peak - start) / simulated peak of the measured table):
the device's memory on GPU, resident set size on CPU. The simulator counts activations in units, not bytes, for
the measured costs carry none; this scale is what lets the re-planner leave out a table that would not fit
(:mod:`~primuspipe.calibration.replan_decision`) and lets zb-auto plan within the limit by the same count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from primuspipe.io.timeline import Timeline


@dataclass(frozen=True)
class MemoryPrediction:
    """Per rank: memory at step start and bytes per simulated activation unit (the module docstring)."""

    start: tuple[float, ...] | None
    per_unit: tuple[float, ...] | None
    limit: float | None
    note: str | None = None

    @classmethod
    def of(cls, timelines: Sequence[Timeline], simulated_units: Sequence[float], limit: float | None) -> MemoryPrediction:
        starts: dict[int, list[float]] = {}
        peaks: dict[int, list[float]] = {}
        for t in timelines:
            facts = {f["rank"]: f for f in t.meta.get("ranks", ())}
            for rt in t.ranks:
                at_start = facts.get(rt.rank, {}).get("memory_at_start")
                if rt.peak_memory_bytes is None or at_start is None:
                    return cls(None, None, limit, "no memory figures in the measured steps: memory not predicted")
                starts.setdefault(rt.rank, []).append(at_start)
                peaks.setdefault(rt.rank, []).append(rt.peak_memory_bytes)
        pp = len(simulated_units)
        start = tuple(min(starts[r]) for r in range(pp))
        per_unit = tuple(max(0.0, max(peaks[r]) - start[r]) / units if units > 0 else 0.0
                         for r, units in enumerate(simulated_units))
        return cls(start, per_unit, limit)

    def unit_limit(self) -> float | None:
        """The limit as activation units (the simulator's ``peak_activations``) that keep every rank's
        :meth:`predict` within it -- the tightest rank's -- for the memory-aware algorithms (zb-auto) to plan
        within, so what they build is judged by the count they planned with. None: no limit, memory not
        predicted, or no room at all (every candidate is then judged over the limit)."""
        if self.start is None or self.limit is None:
            return None
        room = [(self.limit - s) / k for s, k in zip(self.start, self.per_unit) if k > 0]
        return min(room) if room and min(room) > 0 else None

    def predict(self, units: Sequence[float]) -> tuple[float, ...] | None:
        """Each rank's memory with ``units`` simulated peak activations; None where memory is not predicted."""
        if self.start is None:
            return None
        return tuple(s + u * k for s, u, k in zip(self.start, units, self.per_unit))
