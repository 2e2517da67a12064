"""Measured cost models: the simulator's costs learnt from timelines of real steps.

A run dump (``dump_pp_data``, see docs/pp_vis.md) times every node of a step; the simulator wants a
cost model. :func:`measure_costs` goes from one to the other, so ``primuspipe simulate --cost FILE``
replays the measured step and ranks other algorithms under the measured costs. Every term of the cost
model is measured (docs/simulator.md, "Calibration"):

* **compute** -- per (model stage, kind), the mean node time of each iteration, then the median over
  the iterations kept (the first ``warmup`` iterations are dropped: allocator growth, autotuning and
  lazy initialisation make them slow). A chunk's first node of a kind in a step is left out of the
  mean; how much longer it takes than the rest is its **cold start** (median over ranks and chunks).
  FB nodes (an F overlapped with a B) give ``fb_overlap``.
* **host** -- a rank's time between nodes. Walking each rank's nodes in table order, the rank is free
  to go on at the end of its last compute node or posting, or, for a compute node whose input arrived
  later, at that arrival (a receive's end: when the runner got the tensor); a posting's host time is
  from then to its stamp (posts are stamped once made), a compute node's from then to its start.
  Medians per kind.
* **p2p** -- a compute node that waited for its input (the input arrived later than the rank was free
  by more than an input-less node's host time, i.e. more than taking an already-arrived input takes)
  gives one sample of the transfer time: the arrival minus the later of the two postings (median).
  Where events carry message sizes of at least two kinds, ``latency + bytes / bandwidth`` is fitted.
* **cores** -- ranks on one host's CPUs may slow each other (and other processes may slow them).
  Events of such a run carry their thread's CPU time; the effective number of cores the ranks shared
  is fitted from it (:func:`effective_cores`). When it is below ``pp``, ``host.cores`` is set, work is
  what a node took of its thread's CPU time, not its wall time (a node that waited for a core took
  longer without working more), host times are CPU times too, and the CPU each process spent outside
  its main thread (communication and runtime threads), over the time the rank's step took, is
  ``host.background``: a share of a core (it follows the step's length, not its message count).
  Where the ranks outnumbered the free cores, a node took more CPU the more ranks were busy beside it;
  that share is ``host.contention`` (calibration/crowding.py), and node times are taken at no crowding.

Any timeline of the shared format works, simulated ones too, which is how the round trip simulate ->
calibrate -> simulate is tested, exactly.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from primuspipe.calibration.crowding import coverage, excess_during, fit_contention
from primuspipe.calibration.replay import executed_table, placement_of, run_table
from primuspipe.errors import TableFormatError
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.io.timeline import TimedNode, Timeline
from primuspipe.simulator import simulate


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
    """Median transfer time of the transfers a consumer waited for (see the module docstring); None
    without any (the latency part when a bandwidth was fitted)."""
    peak_memory_bytes: tuple[int | None, ...]
    """Per rank, the highest peak over the iterations kept; None where not measured."""
    notes: tuple[str, ...] = ()
    """Assumptions the figures rest on, for people (written into the cost file's header)."""
    cold_start: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None = None
    """Per stage, the extra time of a chunk's first F, B and W of a step; None when none was longer."""
    host_overhead: dict[str, float] = field(default_factory=dict)
    """Per compute kind (lower-case name), the host time before each of its nodes."""
    host_post: dict[str, float] = field(default_factory=dict)
    """``send`` / ``recv``: the host time to post one."""
    p2p_bandwidth: float | None = None
    """Bytes per time unit, fitted where messages of several sizes were timed; None otherwise."""
    message_bytes: int | None = None
    """The size of the run's messages (the most common one), where the dump records sizes."""
    cores: float | None = None
    """Cores the ranks shared (``host.cores``); None when each rank had its own."""
    background: float | None = None
    """With ``cores``: the share of a core each rank's process kept busy outside its main thread."""
    contention: float | None = None
    """With ``cores``: extra CPU per unit of work per busy rank beyond the free cores (crowding.py);
    None where the run cannot tell (a core per rank)."""
    step_gap: tuple[float, ...] | None = None
    """Per rank, the time from its step's end to its next step's start (consecutive dumped iterations);
    None where the dump cannot tell."""

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
        if self.cold_start is not None:
            compute["cold_start"] = {key: values(v) for key, v in zip("fbw", self.cold_start)}
        out: dict[str, Any] = {"time_unit": self.time_unit, "compute": compute}
        host: dict[str, Any] = {}
        if any(self.host_overhead.values()):
            host["overhead"] = dict(self.host_overhead)
        host.update((k, v) for k, v in self.host_post.items() if v)
        if self.cores is not None:
            host["cores"] = self.cores
            if self.background:
                host["background"] = self.background
            if self.contention:
                host["contention"] = self.contention
        if self.step_gap is not None:
            host["step_gap"] = list(self.step_gap)
        if host:
            out["host"] = host
        p2p: dict[str, Any] = {}
        if self.message_bytes:
            p2p["message_bytes"] = self.message_bytes
        if self.cores is not None:
            p2p["ranks_per_node"] = self.pp  # the run's ranks shared one host's cores
        if self.p2p_latency or self.p2p_bandwidth:
            link: dict[str, Any] = {"latency": self.p2p_latency or 0.0}
            if self.p2p_bandwidth:
                link["bandwidth"] = self.p2p_bandwidth
            p2p.update(intra_node=dict(link), inter_node=dict(link))
        if p2p:
            out["p2p"] = p2p
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
    walks = [list(_walk(t, placement)) for t in used]  # every rank's nodes in table order, once per timeline
    cores = effective_cores(used, walks)
    background = [share for t in used for share in _background_shares(t)] if cores is not None else []
    background_share = _significant(statistics.median(background)) if background else None
    contention, slowdowns = None, [{} for _ in used]
    if cores is not None and (free := cores - (background_share or 0.0) * first.pp) > 0:
        contention, slowdowns, fitted = _contention(walks, placement, free)
        if contention is not None:
            notes.append(f"a node took {contention:.3g} more CPU for each rank busy beyond the {free:.3g} free cores "
                         f"(fitted over {fitted} nodes): compute times are taken at no crowding, and "
                         "host.contention charges it back where a schedule crowds the cores")
    samples = [_Samples.of(steps, placement, use_cpu=cores is not None, slowdown=slowdown)
               for steps, slowdown in zip(walks, slowdowns)]
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
    cold = _cold_start(samples, n, fused_only)
    host_overhead = _medians(s.host for s in samples)
    host_post = _medians(s.post for s in samples)
    latency, bandwidth, size = _transfer_fit(samples)

    def host_time(kind: NodeKind) -> float:
        """What the rank spends on the host before a node of ``kind`` (as measured just above)."""
        if kind.is_compute:
            return host_overhead.get(kind.name.lower(), 0.0)
        return host_post.get("post_send" if kind.is_send else "post_recv", 0.0)

    gaps = _step_gaps(used, host_time)
    peaks = []
    for rank in range(first.pp):
        seen = [rt.peak_memory_bytes for t in used for rt in t.ranks
                if rt.rank == rank and rt.peak_memory_bytes is not None]
        peaks.append(max(seen) if seen else None)
    measured = MeasuredCosts(
        first.algorithm, first.pp, first.vpp, first.microbatches, first.time_unit,
        tuple(t.iteration for t in used), tuple(f), tuple(b), tuple(w), fused,
        _significant(statistics.median(overlaps)) if overlaps else None, latency,
        tuple(peaks), tuple(dict.fromkeys(notes)), cold, host_overhead,
        {k.removeprefix("post_"): v for k, v in host_post.items()}, bandwidth, size, cores,
        background_share, contention and _significant(contention), gaps,
    )
    if cores is None:
        return measured
    replayed = replayed_cores(measured, used, placement)
    refit = "" if replayed == cores else (f"; {cores:g} by that fit, with which the run's own node order replayed more "
                                          f"than {REPLAY_TOLERANCE:.0%} off its step time")
    return replace(measured, cores=replayed, notes=(*measured.notes, (
        f"the {first.pp} ranks ran as if sharing {replayed:g} cores (fitted from how much longer than their CPU time "
        f"nodes took while others were busy{refit}): compute and host times are CPU times, and host.cores makes the "
        "simulator share the cores the same way")))


def effective_cores(timelines: Sequence[Timeline], walks: Sequence[Sequence[_Step]]) -> float | None:
    """The cores a run's ranks behaved as sharing, or None if they did not slow each other.

    Only a run on one host's CPUs (every rank's dump names the same host, events carry the rank
    thread's CPU time) can share cores. A rank is *busy* from the moment it is free to go on (its
    previous node done, or the input it waited for arrived) to the end of its next node; were ``C``
    cores shared evenly among the ``n(t)`` busy ranks (processor sharing), the ranks together would
    get ``min(n(t), C)`` seconds of CPU per second. ``C`` is the value for which that matches the CPU
    time the busy ranks actually got, their processes' communication threads included (a bisection:
    the total grows with ``C``); :func:`replayed_cores` then holds it to the run's replay. Other processes on the
    host lower it below the core count. None when it reaches ``pp`` (nothing was shared)."""
    first = timelines[0]
    facts = first.meta.get("ranks") or []
    if len(facts) != first.pp or None in (hosts := {r.get("host") for r in facts}) or len(hosts) != 1:
        return None
    if not all(e.cpu is not None for t in timelines for rt in t.ranks for e in rt.events):
        return None
    busy: list[tuple[float, float]] = []
    got = 0.0  # CPU seconds the ranks' own threads got while busy
    for i, timeline in enumerate(timelines):
        apart = i * 1e6 * (1 + timeline.step_time)  # lay the iterations far apart on one time line
        for start, end, cpu in _busy_intervals(walks[i]):
            if cpu is None:
                return None
            busy.append((start + apart, end + apart))
            got += cpu
        got += sum(_outside_cpu(timeline).values())
    pieces = _levels(busy)

    def cpu_at(cores: float) -> float:
        """CPU seconds the busy ranks would get on ``cores`` shared cores."""
        return sum(span * min(count, cores) for span, count in pieces)

    if not busy or cpu_at(first.pp) <= got * (1 + 1e-9):
        return None
    low, high = 0.0, float(first.pp)
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if cpu_at(mid) < got else (low, mid)
    return _significant(round(high, 2))


def replayed_cores(measured: MeasuredCosts, timelines: Sequence[Timeline], placement: Placement) -> float:
    """``measured.cores`` (the CPU fit of :func:`effective_cores`), or, where the run's own node order
    replayed under ``measured`` misses the run's step time (median over ``timelines``) by more than
    :data:`REPLAY_TOLERANCE`, the core count at which it takes that time (a bisection between 0 and
    ``pp``; the replay's step only shrinks as cores are added). The CPU fit assumes every rank that is
    free to go on competes for a core and that communication threads' CPU falls while ranks work; the
    replay holds the simulator to what the run took under the simulator's own sharing rule."""
    table = executed_table(timelines[0], placement)
    data = measured.cost_dict(per_model_stage=True)
    target = statistics.median(t.step_time for t in timelines)

    def step_at(cores: float) -> float:
        data["host"]["cores"] = cores
        return simulate(table, CostModel.from_dict(data, pp=measured.pp, vpp=measured.vpp)).step_time

    if abs(step_at(measured.cores) / target - 1) <= REPLAY_TOLERANCE:
        return measured.cores
    low, high = 0.0, float(measured.pp)
    if step_at(high) > target:  # slower than the run even with a core per rank: no sharing explains it
        return high
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if step_at(mid) > target else (low, mid)
    return _significant(round(high, 2))


REPLAY_TOLERANCE = 0.01
"""Relative miss of the replayed step under the CPU fit of the cores beyond which the replay refits them."""


def _outside_cpu(timeline: Timeline) -> dict[int, float]:
    """Per rank that says it, the CPU its process spent outside its own thread in the step (the
    communication threads that carry its messages, runtime threads)."""
    out = {}
    for facts in timeline.meta.get("ranks", ()):
        if "process_cpu" in facts and "thread_cpu" in facts:
            out[facts["rank"]] = max(0.0, facts["process_cpu"] - facts["thread_cpu"])
    return out


def _background_shares(timeline: Timeline) -> list[float]:
    """Per rank that says it, the CPU its process spent outside its own thread over its step's span
    (``RankTimeline.span``): the share of a core ``host.background`` is."""
    spans = {rt.rank: rt.span for rt in timeline.ranks}
    return [cpu / spans[rank] for rank, cpu in _outside_cpu(timeline).items() if spans.get(rank, 0) > 0]


def _contention(walks: Sequence[Sequence[_Step]], placement: Placement, free: float):
    """``(contention, per timeline {(rank, node): CPU per unit of work}, nodes fitted)``: each compute
    node's excess -- busy ranks beyond ``free`` cores while it ran, busy as :func:`effective_cores`
    counts it -- against its CPU time, per kind and stage (crowding.py), over each timeline's walk."""
    points, excesses = [], []
    for steps in walks:
        busy = [(start, end) for start, end, _ in _busy_intervals(steps)]
        nodes = [(s.rank, s.event) for s in steps
                 if s.event.node.kind.is_compute and s.event.node.pair is None and s.event.cpu is not None]
        excess = excess_during(busy, [(e.start, e.end) for _, e in nodes], free)
        excesses.append(dict(zip(((rank, e.node) for rank, e in nodes), excess)))
        points += [((e.node.kind, placement.stage(rank, e.node.chunk)), x, e.cpu_time)
                   for (rank, e), x in zip(nodes, excess)]
    share = fit_contention(points)
    if share is None:
        return None, [{} for _ in walks], 0
    return share, [{key: 1 + share * x for key, x in e.items()} for e in excesses], len(points)


def _busy_intervals(steps: Sequence[_Step]) -> list[tuple[float, float, float | None]]:
    """When each rank was busy (see :func:`effective_cores`) over one timeline's walk, with the CPU time
    its thread got then (None where the timeline has no CPU times)."""
    out = []
    for step in steps:
        if step.ready is None:
            continue
        e = step.event
        end, done_cpu = (e.end, e.cpu and e.cpu[1]) if e.node.kind.is_compute else (e.start, e.cpu and e.cpu[0])
        if end > step.ready[0]:
            cpu = None if done_cpu is None or step.ready[1] is None else done_cpu - step.ready[1]
            out.append((step.ready[0], end, cpu))
    return out


def _levels(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """How many intervals cover the time line, as ``(duration, count)`` pieces."""
    times, counts = coverage(intervals)
    return [(following - t, count) for t, following, count in zip(times, times[1:], counts)]


def _step_gaps(timelines: Sequence[Timeline], host_time) -> tuple[float, ...] | None:
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
    return tuple(_significant(statistics.median(gaps[r])) for r in range(pp))


def _medians(groups) -> dict[str, float]:
    pooled: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        for key, values in group.items():
            pooled[key] += values
    return {key: _significant(max(0.0, statistics.median(v))) for key, v in sorted(pooled.items())}


def _cold_start(samples: list[_Samples], n: int, fused_only: list[int]):
    """Per stage and kind (F, B, W), the median extra time of a chunk's first node; None if none is
    longer. A fused-only stage's BW extra is split like its time."""
    def extra(kind: NodeKind, stage: int) -> float:
        values = [x for s in samples for x in s.cold.get((kind, stage), ())]
        return max(0.0, statistics.median(values)) if values else 0.0

    f = [extra(NodeKind.F, s) for s in range(n)]
    b = [extra(NodeKind.BW, s) / 2 if s in fused_only else extra(NodeKind.B, s) for s in range(n)]
    w = [extra(NodeKind.BW, s) / 2 if s in fused_only else extra(NodeKind.W, s) for s in range(n)]
    if not any(f + b + w):
        return None
    return tuple(tuple(map(_significant, v)) for v in (f, b, w))


def _transfer_fit(samples: list[_Samples]):
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
            return _significant(latency), _significant(1 / slope), size
    return _significant(max(0.0, _quartile([t for _, t in points]))), None, size


def _quartile(values: list[float]) -> float:
    """The lower quartile: a waited-for transfer's time is the link's plus whatever kept the receiver
    from running (a busy core, a descheduled thread -- modelled apart, by ``host.cores``), so the
    transfers least held up say what the link takes."""
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


def _significant(x: float) -> float:
    """``x`` to 12 significant digits: drops the float noise of ``end - start`` (1.0 not
    0.9999999999999998) and stays far below any clock's resolution."""
    return float(f"{x:.12g}")


@dataclass(frozen=True)
class _Samples:
    """What one timeline says about each cost term (see the module docstring)."""

    durations: dict[tuple[NodeKind, int], list[float]]
    """(kind, model stage) -> time of its nodes, chunks' first ones left out (work, with shared cores)."""
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

    @classmethod
    def of(cls, steps: Sequence[_Step], placement: Placement, *, use_cpu: bool,
           slowdown: dict[tuple[int, ScheduleNode], float]) -> _Samples:
        """From one timeline's walk (:func:`_walk`). ``slowdown``: per ``(rank, node)``, the CPU per unit
        of work it ran at (crowded cores); a node's work is its CPU time over it."""
        # what a node that cannot wait (it takes no transfer) spends on the host: the tolerance below
        # which an input arriving after the rank was free is the cost of taking it, not a wait
        free_gaps = [_gap(s.ready, s.event, False) for s in steps
                     if s.ready is not None and s.event.node.kind.is_compute and not s.takes_input]
        tolerance = statistics.median(free_gaps) if free_gaps else 0.0

        def span(e: TimedNode, rank: int) -> float:
            if use_cpu and e.cpu is not None:
                return e.cpu_time / slowdown.get((rank, e.node), 1.0)
            return e.end - e.start

        durations: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        firsts: list[tuple[NodeKind, int, float]] = []
        seen: set[tuple] = set()
        pairs, waits = [], []
        host: dict[str, list[float]] = defaultdict(list)
        post: dict[str, list[float]] = defaultdict(list)
        for step in steps:
            e, rank = step.event, step.rank
            node, kind = e.node, e.node.kind
            if not kind.is_compute:
                if step.ready is not None:
                    post[f"post_{'send' if kind.is_send else 'recv'}"].append(_gap(step.ready, e, use_cpu))
                continue
            if node.pair is not None:
                (_, _, fc), (_, _, bc) = node.parts()
                pairs.append((placement.stage(rank, fc), placement.stage(rank, bc), e.end - e.start))
            else:
                stage = placement.stage(rank, node.chunk)
                if (rank, kind, node.chunk) in seen:
                    durations[(kind, stage)].append(span(e, rank))
                else:
                    seen.add((rank, kind, node.chunk))
                    firsts.append((kind, stage, span(e, rank)))
            if step.ready is None:
                continue
            host[kind.name.lower()].append(_gap(step.ready, e, use_cpu))
            if step.waited is not None and step.idle > tolerance:  # longer than taking an input takes
                send, recv = step.waited
                waits.append((recv.end - max(send.start, recv.start), recv.bytes))
        cold: dict[tuple[NodeKind, int], list[float]] = defaultdict(list)
        for kind, stage, took in firsts:
            if rest := durations.get((kind, stage)):
                cold[(kind, stage)].append(_significant(took) - _significant(statistics.median(rest)))
            else:  # a chunk with one node of this kind: it is all there is to time
                durations[(kind, stage)].append(took)
        return cls(dict(durations), dict(cold), pairs, dict(host), dict(post), waits)


@dataclass(frozen=True)
class _Step:
    """One node of a rank's row as it ran, with when the rank was ready to start on it."""

    rank: int
    event: TimedNode
    ready: tuple[float, float | None] | None
    """``(wall time, CPU time)`` the rank was free to go on with this node: the end of its previous
    compute node or the stamp of its previous posting, or, for a compute node whose input arrived
    later, that arrival (a receive's end). None before the rank's first node or after a missing one."""
    takes_input: bool
    """A compute node that consumes a transfer."""
    waited: tuple[TimedNode, TimedNode] | None = None
    """``(send, receive)`` of the input that arrived after the rank was free, if one did."""
    idle: float = 0.0
    """How long the rank was free before that input arrived."""


def _walk(timeline: Timeline, placement: Placement) -> Iterator[_Step]:
    """Every recorded node of every rank, in table order (the full table the run executed)."""
    table = run_table(timeline, placement)
    wiring = table.wiring
    events = {rt.rank: {e.node: e for e in rt.events} for rt in timeline.ranks}
    rows = [[events.get(rank, {}).get(node) for node in row] for rank, row in enumerate(table.ranks)]
    sent: dict[int, TimedNode] = {}
    received: dict[int, TimedNode] = {}
    for rank, row in enumerate(table.ranks):
        for node, e, key in zip(row, rows[rank], wiring.moves[rank]):
            if key >= 0 and e is not None:
                (sent if node.kind.is_send else received)[key] = e
    for rank, row in enumerate(table.ranks):
        free = None
        for e, taken in zip(rows[rank], wiring.takes[rank]):
            if e is None:
                free = None
                continue
            step = _Step(rank, e, free, bool(taken))
            ends = [(sent.get(key), received.get(key)) for key in taken]
            if free is not None and ends and all(x is not None and r is not None for x, r in ends):
                send, recv = max(ends, key=lambda pair: pair[1].end)
                if recv.end > free[0]:
                    step = replace(step, ready=(recv.end, recv.cpu and recv.cpu[1]), waited=(send, recv),
                                   idle=recv.end - free[0])
            yield step
            free = (e.end, e.cpu and e.cpu[1]) if e.node.kind.is_compute else (e.start, e.cpu and e.cpu[0])


def _gap(free: tuple[float, float | None], e: TimedNode, use_cpu: bool) -> float:
    """Host time from the rank being free to this event's start: CPU time where cores were shared."""
    if use_cpu and e.cpu is not None and free[1] is not None:
        return e.cpu[0] - free[1]
    return e.start - free[0]
