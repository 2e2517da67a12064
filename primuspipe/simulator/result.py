"""What one simulated step did: per-rank times and memory (:class:`RankResult`) and the step's summary figures
(:class:`SimulationResult`), and its timeline document."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from primuspipe.io.timeline import RankTimeline, TimedNode, Timeline, idle_share
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable


@dataclass(frozen=True)
class RankResult:
    rank: int
    nodes: tuple[ScheduleNode, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]
    """For compute nodes, when they run; for sends/receives, when posted and when the transfer arrived."""
    busy_time: float
    """Total compute time (communication is assumed to overlap compute)."""
    bubble_rate: float
    """``(step - busy) / step``: idle share of the whole step, start-up wait included."""
    peak_activations: float
    """Most activations held at once, in 1F1B-stage microbatches (a chunk's F counts 1/vpp), each from
    its F until its W (at the cost model's ``w_retained_fraction`` between B and W)."""
    peak_activation_bytes: float
    static_bytes: float
    cpu: tuple[tuple[float, float], ...] | None = None
    """With ranks sharing cores (``host.cores``): per node, the CPU time this rank had got by its start
    and by its end (as a run dump records it); None otherwise."""
    entered: float = 0.0
    """When the rank entered the step: 0, or with step gaps its steady-state offset."""

    @property
    def peak_memory_bytes(self) -> float:
        return self.static_bytes + self.peak_activation_bytes

    @property
    def span_bubble_rate(self) -> float:
        """Idle share of this rank's own span, from its first compute start to its last compute end."""
        times = [(s, e) for n, s, e in zip(self.nodes, self.starts, self.ends)
                 if n.kind.is_compute and not n.kind.on_host_stream]
        if not times:
            return 0.0
        return idle_share(max(e for _, e in times) - min(s for s, _ in times), self.busy_time)

    @cached_property
    def events(self) -> tuple[TimedNode, ...]:
        return tuple(map(TimedNode, self.nodes, self.starts, self.ends, self.cpu or (None,) * len(self.nodes)))


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated step did: per-rank timings and memory, and the step's summary figures."""

    table: ScheduleTable
    """The full table that was simulated (with communication)."""
    cost: CostModel
    """The cost model it was timed with."""
    step_time: float
    """From the step's start to its last node's end, in the cost model's time unit."""
    ranks: tuple[RankResult, ...]
    """Per rank, in rank order."""
    period: float | None = None
    """With step gaps (``host.step_gap``): the steady-state time from one step's start to the next's,
    ranks entering each step at their ``starts`` offsets; None without."""

    @property
    def bubble_rate(self) -> float:
        """The worst rank's bubble rate."""
        return max(r.bubble_rate for r in self.ranks)

    @property
    def bubble_rate_mean(self) -> float:
        return sum(r.bubble_rate for r in self.ranks) / len(self.ranks)

    @property
    def span_bubble_rate(self) -> float:
        """The zero-bubble papers' figure: idle share of each rank's own span (first compute start to
        last compute end), worst rank. A later rank's start-up wait is not counted, as in a pipeline
        whose optimizer step does not synchronise ranks (the ZB paper's post-validation); with a
        synchronous optimizer step, :attr:`bubble_rate` is the one that costs time."""
        return max(r.span_bubble_rate for r in self.ranks)

    @property
    def peak_activations(self) -> list[float]:
        return [r.peak_activations for r in self.ranks]

    @property
    def peak_memory_bytes(self) -> list[float]:
        return [r.peak_memory_bytes for r in self.ranks]

    def event_log(self) -> list[tuple[float, float, int, str]]:
        """Every node as ``(start, end, rank, node text)``, ordered by start, then rank, then table order."""
        keyed = [(s, r.rank, i, e, str(n)) for r in self.ranks
                 for i, (n, s, e) in enumerate(zip(r.nodes, r.starts, r.ends))]
        return [(s, e, rank, text) for s, rank, _, e, text in sorted(keyed)]

    def timeline(self, iteration: int = 0) -> Timeline:
        """The shared timeline format (see docs/timeline-format.md); ``meta`` carries the cost model,
        placement and summary figures."""
        t = self.table
        meta = {
            "placement": t.placement.to_dict(),
            "cost_model": self.cost.to_dict(),
            "step_time": self.step_time,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_mean": self.bubble_rate_mean,
            "bubble_rate_span": self.span_bubble_rate,
            "peak_activations": self.peak_activations,
        }
        modelled = self.cost.memory.models_bytes  # without activation bytes, bytes are unknown, not zero
        ranks = tuple(RankTimeline(r.rank, r.events, round(r.peak_memory_bytes) if modelled else None)
                      for r in self.ranks)
        facts: list[dict] = [{"rank": r.rank} for r in self.ranks]  # what a run dump says per rank
        if self.period is not None:
            meta["period"] = self.period
            for fact, r in zip(facts, self.ranks):
                fact["entered"] = r.entered
        if self.cost.host.cores is not None:  # which ranks share cores, and the CPU their processes took
            for fact, r, rt in zip(facts, self.ranks, ranks):
                thread = max((c[1] for c in r.cpu or ()), default=0.0)
                fact.update(host=f"node {fact['rank'] // self.cost.p2p.ranks_per_node}", thread_cpu=thread,
                            process_cpu=thread + self.cost.host.background * rt.span
                            + self.cost.host.message_cpu * rt.messages)
        if len(facts[0]) > 1:
            meta["ranks"] = facts
        return Timeline("simulator", t.algorithm, t.pp, t.vpp, t.microbatches, ranks, iteration,
                        self.cost.time_unit, meta)
