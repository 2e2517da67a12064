"""Figures of a timeline (step time, bubble, per-kind mean node time, memory) and real vs simulated.

Bubble rate is the simulator's: per rank ``(step - busy) / step`` with busy the rank's compute time and
step the whole timeline's span, so a run and its simulation are measured by one rule.

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.simulator import CostModel, simulate
>>> timeline = simulate(build_schedule("1f1b", pp=4, microbatches=8), CostModel.per_stage(4, 1, 1, 1)).timeline()
>>> stats = timeline_stats(timeline)
>>> stats.step_time, round(stats.bubble_rate, 4), stats.kind_means
(33.0, 0.2727, {'F': 1.0, 'BW': 2.0})
>>> compare_timelines(timeline, timeline).order_differences
()
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from itertools import zip_longest

from primuspipe import strict
from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.simulator import CostModel, simulate
from primuspipe.calibration.replay import compute_order, executed_table
from primuspipe.io.timeline import Timeline, idle_share
from primuspipe.tools.pp_vis.load import in_unit


@dataclass(frozen=True)
class TimelineStats:
    """The figures pp_vis reports for one timeline, run or simulated, by one rule."""

    label: str
    """Where the timeline comes from, for people: ``"run"`` or ``"simulator"`` and its iteration."""
    ranks: tuple[int, ...]
    """The ranks present, ascending."""
    time_unit: str
    step_time: float
    """The timeline's span: first node start to last node end."""
    busy: tuple[float, ...]
    """Per rank (as ordered in ``ranks``): total compute time."""
    kind_means: dict[str, float]
    """Mean duration of each compute kind present (``"F"``, ``"B"``, ``"W"``, ``"BW"``, ``"FB"``)."""
    kind_cpu_means: dict[str, float]
    """Mean CPU time of each compute kind whose nodes all carry it (a run's dump on CPU, a simulation
    with ranks sharing cores). Beside :attr:`kind_means` because a node of a rank time-sliced off its
    core lasts longer than its CPU time in a run's dump, while the simulator puts that wait before it."""
    peak_memory_bytes: tuple[int | None, ...]

    @property
    def bubble_rates(self) -> tuple[float, ...]:
        return tuple(idle_share(self.step_time, b) for b in self.busy)

    @property
    def bubble_rate(self) -> float:
        """The worst rank's bubble rate."""
        return max(self.bubble_rates, default=0.0)

    @property
    def bubble_rate_mean(self) -> float:
        rates = self.bubble_rates
        return sum(rates) / len(rates) if rates else 0.0


def timeline_stats(timeline: Timeline) -> TimelineStats:
    durations: dict[NodeKind, list[float]] = defaultdict(list)
    cpu_times: dict[NodeKind, list[float | None]] = defaultdict(list)
    ranks = sorted(timeline.ranks, key=lambda r: r.rank)
    busy = []
    for rt in ranks:
        total = 0.0
        for e in rt.events:
            if e.node.kind.is_compute:
                durations[e.node.kind].append(e.end - e.start)
                cpu_times[e.node.kind].append(e.cpu_time)
                if not e.node.kind.on_host_stream:  # host copies run beside the compute
                    total += e.end - e.start
        busy.append(total)
    means = {k.name: statistics.fmean(durations[k]) for k in compute_kinds() if durations[k]}
    cpu_means = {k.name: statistics.fmean(cpu_times[k]) for k in compute_kinds()
                 if cpu_times[k] and None not in cpu_times[k]}
    return TimelineStats(f"{timeline.source} (iteration {timeline.iteration})", tuple(r.rank for r in ranks),
                         timeline.time_unit, timeline.step_time, tuple(busy), means, cpu_means,
                         tuple(r.peak_memory_bytes for r in ranks))


@dataclass(frozen=True)
class OrderDifference:
    """Position ``index`` of rank ``rank``'s compute sequence holds different nodes in the two timelines
    (None where one sequence is shorter)."""

    rank: int
    index: int
    run: ScheduleNode | None
    simulated: ScheduleNode | None


@dataclass(frozen=True)
class Figure:
    """One compared quantity; None where a timeline lacks it (a kind it never ran, unmeasured memory)."""

    name: str
    run: float | None
    simulated: float | None

    @property
    def difference(self) -> float | None:
        """``simulated - run``."""
        return None if self.run is None or self.simulated is None else self.simulated - self.run

    @property
    def relative(self) -> float | None:
        """``(simulated - run) / run``; None when run is 0 or missing."""
        d = self.difference
        return None if d is None or not self.run else d / self.run


@dataclass(frozen=True)
class Comparison:
    """A run and a simulation of the same table, on the run's time unit."""

    run: Timeline
    simulated: Timeline
    """Converted to the run's time unit."""
    run_stats: TimelineStats
    simulated_stats: TimelineStats
    order_differences: tuple[OrderDifference, ...]

    def figures(self) -> list[Figure]:
        """Per-kind mean node times (and CPU times where both timelines carry them), step time, bubble
        rates, then peak memory per rank."""
        r, s = self.run_stats, self.simulated_stats
        kinds = [k.name for k in compute_kinds() if k.name in r.kind_means or k.name in s.kind_means]
        out = [Figure(f"{k} mean", r.kind_means.get(k), s.kind_means.get(k)) for k in kinds]
        out += [Figure(f"{k} CPU mean", r.kind_cpu_means[k], s.kind_cpu_means[k]) for k in kinds
                if k in r.kind_cpu_means and k in s.kind_cpu_means]
        out += [Figure("step time", r.step_time, s.step_time), Figure("bubble rate max", r.bubble_rate, s.bubble_rate),
                Figure("bubble rate mean", r.bubble_rate_mean, s.bubble_rate_mean)]
        memory = dict(zip(s.ranks, s.peak_memory_bytes))
        out += [Figure(f"peak memory rank {rank} (bytes)", run_bytes, memory.get(rank))
                for rank, run_bytes in zip(r.ranks, r.peak_memory_bytes)]
        return out

    @property
    def run_stretch(self) -> float:
        """How much longer than their CPU time the run's compute nodes lasted, worst kind (0.5: half as
        long again; 0 where the run has no CPU times): ranks time-sliced off their cores inside nodes."""
        r = self.run_stats
        return max((r.kind_means[k] / cpu - 1.0 for k, cpu in r.kind_cpu_means.items() if cpu > 0), default=0.0)

    @property
    def marked_nodes(self) -> frozenset[tuple[int, ScheduleNode]]:
        """``(rank, node)`` of every node whose position differs, to highlight in drawings."""
        return frozenset((d.rank, n) for d in self.order_differences for n in (d.run, d.simulated) if n is not None)


@strict.arguments()
def compare_timelines(run: Timeline, simulated: Timeline) -> Comparison:
    """Side-by-side figures and the compute nodes whose order differs, rank by rank."""
    if (run.pp, run.vpp, run.microbatches) != (simulated.pp, simulated.vpp, simulated.microbatches):
        raise TableFormatError(
            f"cannot compare a pp={run.pp} vpp={run.vpp} m={run.microbatches} timeline with a pp={simulated.pp} "
            f"vpp={simulated.vpp} m={simulated.microbatches} one; simulate the run's own shape (e.g. 'primuspipe "
            "vis DUMP --cost FILE' replays the run's table)")
    simulated = in_unit(simulated, run.time_unit)
    ours, theirs = compute_order(run), compute_order(simulated)
    differences = tuple(
        OrderDifference(rank, i, a, b)
        for rank in sorted(set(ours) | set(theirs))
        for i, (a, b) in enumerate(zip_longest(ours.get(rank, ()), theirs.get(rank, ())))
        if a != b
    )
    return Comparison(run, simulated, timeline_stats(run), timeline_stats(simulated), differences)


@strict.arguments()
def replay(timeline: Timeline, cost: CostModel, placement: Placement | None = None) -> Timeline:
    """Simulate the table the timeline ran (its compute order per rank) under ``cost``: the simulated
    counterpart of a run, for :func:`compare_timelines`."""
    result = simulate(executed_table(timeline, placement), cost)
    return result.timeline(iteration=timeline.iteration)
