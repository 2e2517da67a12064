"""Measured cost models: the simulator's per-stage costs learnt from timelines of real steps.

A run dump (``dump_pp_data``, see docs/pp_vis.md) times every node of a step; the simulator wants a
time per (stage, kind). :func:`measure_costs` goes from one to the other, so ``primuspipe simulate
--cost FILE`` replays the measured step and ranks other algorithms under the measured costs.

How a figure is made: per iteration, the mean duration of each (model stage, kind) over its
microbatches; then the median of those means over the iterations kept (the first ``warmup``
iterations are dropped: allocator growth, autotuning and lazy initialisation make them slow). FB nodes
(an F overlapped with a B) give ``fb_overlap``; receives matched with their sends give the p2p latency
(arrival minus the later of the two postings). Any timeline of the shared format works, simulated ones
too, which is how the round trip simulate -> calibrate -> simulate is tested.

The cost file is written per *1F1B stage* by default (``pp`` values: 1F1B stage ``k`` is the sum of
model stages ``k*vpp .. k*vpp+vpp-1``), so it serves every algorithm of the same ``pp`` whatever its
vpp (docs/simulator.md); ``per_model_stage=True`` writes ``pp * vpp`` values instead, exact for this
shape only. At vpp = 1 the two are the same.

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.simulator import CostModel, simulate
>>> timeline = simulate(build_schedule("zb-h1", pp=2, microbatches=4), CostModel.per_stage(2, 1, [2, 3], 1)).timeline()
>>> measured = measure_costs([timeline])
>>> measured.forward, measured.backward_input, measured.backward_weight
((1.0, 1.0), (2.0, 3.0), (1.0, 1.0))
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from primuspipe.calibration.replay import placement_of
from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.placement import Placement
from primuspipe.ir.timeline import Timeline
from primuspipe.simulator.trace import matched_transfers



def _timed_kinds() -> dict[str, NodeKind]:
    """Cost key (``f``, ``b``, ``w``, ``bw``) -> the single-part compute kind it times."""
    return {k.spec.cost: k for k in compute_kinds() if k.spec.cost and not k.spec.parts}


@dataclass(frozen=True)
class MeasuredCosts:
    """Per-model-stage times measured from timelines of one table shape (in ``time_unit``)."""

    algorithm: str
    pp: int
    vpp: int
    microbatches: int
    time_unit: str
    iterations: tuple[int, ...]
    """The iterations the figures come from (warm-up ones excluded)."""
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    """Where the run only had fused BW nodes, B and W are each half of BW (see ``notes``)."""
    fused_backward: tuple[float, ...] | None
    """Measured BW per stage (B + W where a stage had no BW node); None when no stage had one."""
    fb_overlap: float | None
    """From FB nodes: ``(F + B - FB) / min(F, B)`` clamped to [0, 1]; None without FB nodes."""
    p2p_latency: float | None
    """Median time from the later of a send's and its receive's posting to the arrival; None without
    cross-rank receives."""
    peak_memory_bytes: tuple[int | None, ...]
    """Per rank, the highest peak over the iterations kept; None where not measured."""
    notes: tuple[str, ...] = ()
    """Assumptions the figures rest on, for people (written into the cost file's header)."""

    def cost_dict(self, *, per_model_stage: bool = False) -> dict[str, Any]:
        """The cost-file mapping (``CostModel.from_dict``'s YAML form); see the module docstring for
        the 1F1B-stage vs model-stage choice."""
        def values(per_stage: Sequence[float]) -> list[float]:
            if per_model_stage or self.vpp == 1:
                return list(per_stage)
            return [_significant(sum(per_stage[k * self.vpp:(k + 1) * self.vpp])) for k in range(self.pp)]

        compute: dict[str, Any] = {"f": values(self.forward), "b": values(self.backward_input),
                                   "w": values(self.backward_weight)}
        if self.fused_backward is not None:
            compute["bw"] = values(self.fused_backward)
        if self.fb_overlap is not None:
            compute["fb_overlap"] = self.fb_overlap
        out: dict[str, Any] = {"time_unit": self.time_unit, "compute": compute}
        if self.p2p_latency:
            link = {"latency": self.p2p_latency}
            out["p2p"] = {"intra_node": dict(link), "inter_node": dict(link)}
        return out

    def to_yaml(self, *, per_model_stage: bool = False) -> str:
        """A cost file ``primuspipe simulate --cost`` reads, with what was measured in its header
        (peak memory per rank has no field in the format, so it is a comment)."""
        per = ("model stage (pp*vpp values, exact for this shape only)" if per_model_stage and self.vpp > 1
               else "1F1B stage (pp values)")
        memory = ", ".join(f"rank {r}: " + ("not measured" if b is None else f"{b} ({b / 2**30:.3f} GiB)")
                           for r, b in enumerate(self.peak_memory_bytes))
        header = [
            f"primuspipe cost model measured from {self.algorithm} pp={self.pp} vpp={self.vpp} m={self.microbatches}",
            f"iterations used: {', '.join(map(str, self.iterations))} (median of each iteration's mean node time)",
            f"times are per {per}",
            f"measured peak memory per rank: {memory}",
            *self.notes,
        ]
        body = yaml.safe_dump(self.cost_dict(per_model_stage=per_model_stage), sort_keys=False, default_flow_style=None)
        return "".join(f"# {line}\n" for line in header) + body


def measure_costs(timelines: Sequence[Timeline], placement: Placement | None = None, *,
                  warmup: int = 1) -> MeasuredCosts:
    """Costs from timelines of one table shape (a run's iterations, oldest first). The first
    ``warmup`` are dropped when more remain; otherwise all are used and ``notes`` says so."""
    if not timelines:
        raise TableFormatError("no timelines to measure; dump at least one iteration (dump_pp_data)")
    first = timelines[0]
    shape = (first.algorithm, first.pp, first.vpp, first.microbatches, first.time_unit)
    for t in timelines:
        if (t.algorithm, t.pp, t.vpp, t.microbatches, t.time_unit) != shape:
            raise TableFormatError(f"timelines of different shapes cannot be measured together: {shape} vs "
                                   f"{(t.algorithm, t.pp, t.vpp, t.microbatches, t.time_unit)} "
                                   "(algorithm, pp, vpp, microbatches, time unit); measure one run at a time")
    placement = placement or placement_of(first)
    notes = []
    used = list(timelines[warmup:])
    if not used:
        used = list(timelines)
        notes.append(f"only {len(timelines)} iteration(s), so no warm-up iteration was skipped: times may be high")
    samples = [_samples(t, placement) for t in used]
    n = placement.num_stages

    def median_of(kind: NodeKind) -> list[float | None]:
        out: list[float | None] = []
        for stage in range(n):
            means = [statistics.fmean(d) for s in samples if (d := s.durations.get((kind, stage)))]
            out.append(_significant(statistics.median(means)) if means else None)
        return out

    times = {key: median_of(kind) for key, kind in _timed_kinds().items()}
    f, b, w, bw = (times[key] for key in ("f", "b", "w", "bw"))
    fused_only = []
    for stage in range(n):
        if f[stage] is None:
            raise TableFormatError(f"stage {stage} has no forward (F) node to time; the timeline must run "
                                   "standalone F nodes on every stage")
        if b[stage] is None or w[stage] is None:
            if bw[stage] is None:
                raise TableFormatError(f"stage {stage} has neither B and W nodes nor a BW node to time its "
                                       "backward; the timeline must run every stage's backward")
            b[stage] = w[stage] = bw[stage] / 2
            fused_only.append(stage)
    if fused_only:
        notes.append(f"stage(s) {', '.join(map(str, fused_only))} ran only fused BW: B and W are each taken as "
                     "half of it (only schedules that split them depend on this)")
    fused = None
    if any(x is not None for x in bw):
        fused = tuple(bw[s] if bw[s] is not None else b[s] + w[s] for s in range(n))
    overlaps = [min(1.0, max(0.0, (f[fs] + b[bs] - d) / min(f[fs], b[bs])))
                for s in samples for fs, bs, d in s.pairs if min(f[fs], b[bs]) > 0]
    delays = [statistics.median(s.delays) for s in samples if s.delays]
    peaks = []
    for rank in range(first.pp):
        seen = [rt.peak_memory_bytes for t in used for rt in t.ranks
                if rt.rank == rank and rt.peak_memory_bytes is not None]
        peaks.append(max(seen) if seen else None)
    return MeasuredCosts(
        first.algorithm, first.pp, first.vpp, first.microbatches, first.time_unit,
        tuple(t.iteration for t in used), tuple(f), tuple(b), tuple(w), fused,
        _significant(statistics.median(overlaps)) if overlaps else None,
        _significant(statistics.median(delays)) if delays else None,
        tuple(peaks), tuple(dict.fromkeys(notes)),
    )


def _significant(x: float) -> float:
    """``x`` to 12 significant digits: drops the float noise of ``end - start`` (1.0 not
    0.9999999999999998) and stays far below any clock's resolution."""
    return float(f"{x:.12g}")


@dataclass(frozen=True)
class _Samples:
    durations: dict[tuple[NodeKind, int], list[float]]
    """(kind, model stage) -> durations of its nodes."""
    pairs: list[tuple[int, int, float]]
    """FB nodes as (F's stage, B's stage, duration)."""
    delays: list[float]
    """Per cross-rank transfer: arrival minus the later posting."""


def _samples(timeline: Timeline, placement: Placement) -> _Samples:
    durations: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
    pairs = []
    for rt in timeline.ranks:
        for e in rt.events:
            node = e.node
            if node.pair is not None:
                (_, _, fc), (_, _, bc) = node.parts()
                pairs.append((placement.stage(rt.rank, fc), placement.stage(rt.rank, bc), e.end - e.start))
            elif node.kind.is_compute:
                durations[(node.kind, placement.stage(rt.rank, node.chunk))].append(e.end - e.start)
    delays = [max(0.0, recv.end - max(send.start, recv.start))
              for send, recv in matched_transfers(timeline, placement).values()]
    return _Samples(dict(durations), pairs, delays)
