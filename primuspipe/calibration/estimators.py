"""What one timeline says about each cost term (:class:`Samples`), and the estimators that pool the
samples of the iterations kept into the cost model's figures (medians, the cold start, the link fit,
the gap between steps). The module docstring of :mod:`primuspipe.calibration.measure` says what each
term is measured from.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from primuspipe.calibration.measured import elapsed, significant
from primuspipe.calibration.walk import Step, gap
from primuspipe.io.timeline import TimedNode, Timeline
from primuspipe.ir.kinds import NodeKind, split_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement


@dataclass(frozen=True)
class Samples:
    """What one timeline says about each cost term (see the module docstring)."""

    durations: dict[tuple[NodeKind, int], list[float]]
    """(kind, model stage) -> time of its nodes, chunks' first ones left out (work, with shared cores);
    of the W nodes, the cold ones."""
    warm: dict[tuple[NodeKind, int], list[float]]
    """``(W, model stage)`` -> time of the warm W nodes (``Step.warm``: right after their own B or another
    W of their chunk), likewise."""
    window: dict[tuple[NodeKind, int], list[float]]
    """(kind, model stage) -> time of the nodes that opened a probe window (``Step.window``), which
    ``durations`` leaves out (:func:`window_share`)."""
    cold: dict[tuple[NodeKind, int], list[float]]
    """(kind, model stage) -> how much longer a chunk's first node took than the stage's others."""
    pairs: list[tuple[int, int, float]]
    """FB nodes as (F's stage, B's stage, duration)."""
    host: dict[str, list[float]]
    """Compute kind (lower-case name) -> host time before each of its nodes that did not wait."""
    post: dict[str, list[float]]
    """``post_send`` / ``post_recv`` -> host time of each posting."""
    waits: list[tuple[float, int | None]]
    """Per compute node that waited for its input: how long the transfer took after both ends were
    posted (its arrival is when the consumer went on), and its size in bytes where known."""
    fixed: dict[tuple[NodeKind, int], list[float]]
    """Like ``durations``, the part of each node's time spent outside the model's layers, for nodes whose
    event times the layers (``TimedNode.layers``); empty otherwise."""
    chunk: dict[tuple[NodeKind, int], list[float]]
    """Likewise, the part outside the layers and the first stage's embedding (``TimedNode.ends``): the
    fixed cost every chunk pays."""

    @classmethod
    def of(cls, steps: Sequence[Step], placement: Placement, *, use_cpu: bool,
           slowdown: dict[tuple[int, ScheduleNode], float]) -> Samples:
        """From one timeline's walk (:func:`~primuspipe.calibration.walk.walk`). ``slowdown``: per ``(rank, node)``, the CPU per unit
        of work it ran at (crowded cores); a node's work is its CPU time over it."""
        # what a node that cannot wait (it takes no transfer) spends on the host: the tolerance below
        # which an input arriving after the rank was free is the cost of taking it, not a wait
        free_gaps = [gap(s.ready, s.event, False) for s in steps
                     if s.ready is not None and s.event.node.kind.is_compute and not s.takes_input]
        tolerance = statistics.median(free_gaps) if free_gaps else 0.0

        def span(e: TimedNode, rank: int) -> float:
            if use_cpu and e.cpu is not None:
                return e.cpu_time / slowdown.get((rank, e.node), 1.0)
            return e.end - e.start

        def outside(e: TimedNode, rank: int, parts: tuple[str, ...]) -> float | None:
            """The node's time outside ``parts`` of the model, on the clock :func:`span` reads."""
            if e.layers is None:
                return None
            inside = [getattr(e, part) or (0.0, 0.0) for part in parts]
            if use_cpu and e.cpu is not None:
                if any(cpu is None for _, cpu in inside):
                    return None
                return max(0.0, e.cpu_time - sum(cpu for _, cpu in inside)) / slowdown.get((rank, e.node), 1.0)
            return max(0.0, e.end - e.start - sum(wall for wall, _ in inside))

        def split(e: TimedNode, rank: int) -> tuple[float | None, float | None]:
            """(time outside the layers, time outside the layers and the ends)."""
            return outside(e, rank, ("layers",)), outside(e, rank, ("layers", "ends"))

        durations: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        warm: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        window: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        firsts: list[tuple[dict, NodeKind, int, float, tuple[float | None, float | None]]] = []
        fixed: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        chunk: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        seen: set[tuple] = set()
        pairs, waits = [], []
        host: dict[str, list[float]] = defaultdict(list)
        post: dict[str, list[float]] = defaultdict(list)
        for step in steps:
            e, rank = step.event, step.rank
            node, kind = e.node, e.node.kind
            if not kind.is_compute:
                if step.ready is not None:
                    post[f"post_{'send' if kind.is_send else 'recv'}"].append(gap(step.ready, e, use_cpu))
                continue
            if step.window:  # timed apart, its chunk's first or not (the probe's never is)
                seen.add((rank, kind, node.chunk))
                if node.pair is None:
                    window[(kind, placement.stage(rank, node.chunk))].append(span(e, rank))
            elif node.pair is not None:
                (_, _, fc), (_, _, bc) = node.parts()
                pairs.append((placement.stage(rank, fc), placement.stage(rank, bc), e.end - e.start))
            else:
                stage = placement.stage(rank, node.chunk)
                context = warm if step.warm else durations
                if (rank, kind, node.chunk) in seen:
                    context[(kind, stage)].append(span(e, rank))
                    _add_parts(fixed, chunk, (kind, stage), split(e, rank))
                else:
                    seen.add((rank, kind, node.chunk))
                    firsts.append((context, kind, stage, span(e, rank), split(e, rank)))
            if step.ready is None:
                continue
            host[kind.name.lower()].append(gap(step.ready, e, use_cpu))
            if step.waited is not None and step.idle > tolerance:  # longer than taking an input takes
                send, recv = step.waited
                waits.append((elapsed(max(send.start, recv.start), recv.end), recv.bytes))
        cold: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        for context, kind, stage, took, part in firsts:  # each against the nodes of its own context
            if rest := context.get((kind, stage)):
                cold[(kind, stage)].append(significant(took) - significant(statistics.median(rest)))
            else:  # a chunk with one node of this kind (and context): it is all there is to time
                context[(kind, stage)].append(took)
                _add_parts(fixed, chunk, (kind, stage), part)
        return cls(dict(durations), dict(warm), dict(window), dict(cold), pairs, dict(host), dict(post), waits,
                   dict(fixed), dict(chunk))


def _add_parts(fixed: dict, chunk: dict, key: tuple, parts: tuple[float | None, float | None]) -> None:
    """File a node's time outside the layers and outside layers and ends, where measured."""
    for into, value in zip((fixed, chunk), parts):
        if value is not None:
            into[key].append(value)


def window_share(samples: list[Samples], placement: Placement) -> tuple[tuple[float, ...] | None, list[Samples]]:
    """``compute.probe_window`` per rank -- the median over timelines, kinds and the rank's stages of how
    much longer the nodes that opened a probe window took than the same timeline's other nodes of their kind and
    stage (median against median), 0 where none was longer or the rank had none to compare -- and
    ``samples`` with each window node's time, less its rank's share, among ``durations`` where its kind
    and stage has no other (as they are on a rank of share 0). None where every rank's is 0. Per rank:
    what a window costs follows what the rank holds beside it (on CPU, page faults), which differs by
    rank (:func:`~primuspipe.ir.row_context.probe_windows`)."""
    ratios: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        for key, times in s.window.items():
            if (rest := s.durations.get(key)) and statistics.median(rest) > 0:
                ratios[placement.rank_of(key[1])].append(statistics.median(times) / statistics.median(rest))
    shares = tuple(max(0.0, significant(statistics.median(ratios[r]) - 1)) if ratios[r] else 0.0
                   for r in range(placement.pp))

    def durations(s: Samples) -> dict[tuple[NodeKind, int], list[float]]:
        out = {key: list(times) for key, times in s.durations.items()}
        for key, times in s.window.items():
            share = shares[placement.rank_of(key[1])]
            if not (share > 0 and key in out):
                out.setdefault(key, []).extend(t / (1 + share) for t in times)
        return out

    return (shares if any(shares) else None), [replace(s, durations=durations(s)) for s in samples]


def medians(groups) -> dict[str, float]:
    pooled: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        for key, values in group.items():
            pooled[key] += values
    return {key: significant(max(0.0, statistics.median(v))) for key, v in sorted(pooled.items())}


def cold_start_extras(samples: list[Samples], n: int, fused_only: list[int]) -> dict[str, tuple[float, ...]] | None:
    """Per cost key and stage, the median extra time of a chunk's first node of that kind in a step: F,
    B and W (a fused-only stage's BW extra split like its time), and BW's own where every stage timed
    it and it differs from B's and W's together (a run that splits only some backwards, the split probe:
    its first B and W run mid-step, after BWs, and are not what a step's first backward pays); None if
    no first node is longer."""
    def extra(kind: NodeKind, stage: int) -> float | None:
        values = [x for s in samples for x in s.cold.get((kind, stage), ())]
        return max(0.0, statistics.median(values)) if values else None

    def split(kind: NodeKind, s: int) -> float:  # a fused-only stage's BW: an even share per step it completes
        fused = NodeKind.BW
        if s in fused_only and kind in fused.completes:
            return (extra(fused, s) or 0.0) / len(fused.completes)
        return extra(kind, s) or 0.0

    out = {kind.spec.cost: tuple(significant(split(kind, s)) for s in range(n)) for kind in split_kinds()}
    fused = [extra(NodeKind.BW, s) for s in range(n)]
    if None not in fused and any(significant(x) != significant(out["b"][s] + out["w"][s]) for s, x in enumerate(fused)):
        out["bw"] = tuple(map(significant, fused))
    if not any(x for times in out.values() for x in times):
        return None
    return out


def transfer_fit(samples: list[Samples]):
    """``(latency, bandwidth, message bytes)`` from the waited-for transfers: a least-squares line
    through (bytes, time) where at least two sizes were timed, else the median time."""
    points = [(size, took) for s in samples for took, size in s.waits]
    if not points:
        return None, None, None
    sizes = [size for size, _ in points if size is not None]
    size = max(set(sizes), key=sizes.count) if sizes else None
    if len(set(sizes)) >= 2 and len(sizes) == len(points):
        mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(t for _, t in points)
        slope = (sum((x - mean_x) * (t - mean_y) for x, t in points)
                 / sum((x - mean_x) ** 2 for x in sizes))
        if slope > 0:
            latency = max(0.0, mean_y - slope * mean_x)
            return significant(latency), significant(1 / slope), size
    return significant(max(0.0, _quartile([t for _, t in points]))), None, size


def _quartile(values: list[float]) -> float:
    """The lower quartile: a waited-for transfer's time is the link's plus whatever kept the receiver
    from running (a busy core, a descheduled thread -- modelled apart, by ``host.cores``), so the
    transfers least held up say what the link takes."""
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


def step_gaps(timelines: Sequence[Timeline], host_time) -> tuple[float, ...] | None:
    """Per rank, the median time from the end of its last node of a step to its entering the next,
    over the consecutive dumped iterations, on the wall clock (a run dump's ``t0_unix``). A rank enters
    a step when its recorder starts (its own ``t0_unix``); a timeline without that uses its first
    node's start less that node's host time. None without two consecutive iterations, or if any gap
    is negative (iterations not dumped in time order)."""
    def ends(t: Timeline) -> dict[int, tuple[float, float]]:
        origin = t.meta["t0_unix"]
        entered = {r["rank"]: r["t0_unix"] for r in t.meta.get("ranks", ()) if "t0_unix" in r}
        out = {}
        for rt in t.ranks:
            if rt.events:
                first = min(rt.events, key=lambda e: e.start)
                start = entered.get(rt.rank, origin + first.start - host_time(first.node.kind))
                out[rt.rank] = (start, origin + max(e.end for e in rt.events))
        return out

    by_iteration = {t.iteration: ends(t) for t in timelines if "t0_unix" in t.meta}
    gaps: dict[int, list[float]] = defaultdict(list)
    for k, ranks in by_iteration.items():
        for rank, (_, last) in ranks.items():
            if (after := by_iteration.get(k + 1, {}).get(rank)) is not None:
                gaps[rank].append(after[0] - last)
    pp = timelines[0].pp
    if sorted(gaps) != list(range(pp)) or min(min(v) for v in gaps.values()) < 0:
        return None
    return tuple(significant(statistics.median(gaps[r])) for r in range(pp))


def run_gaps(per_run: Sequence[tuple[float, ...] | None]) -> tuple[float, ...] | None:
    """Several runs' :func:`step_gaps` as one: per rank the median over the runs that tell (a run's
    iteration numbers say nothing about another run's, so each run's gaps are taken on their own);
    None where none does."""
    told = [gaps for gaps in per_run if gaps is not None]
    if not told:
        return None
    return tuple(significant(statistics.median(gaps[r] for gaps in told)) for r in range(len(told[0])))
