"""Ranks sharing a host's cores: how many cores they behaved as sharing (``host.cores``), what their
processes spent off their main threads (``host.background``), and how crowded the cores were while each
node ran and what that cost (``host.contention``).

The cores: were ``C`` cores shared evenly among the busy ranks, the ranks together would get
``min(busy, C)`` seconds of CPU per second; :func:`effective_cores` finds the ``C`` that matches the CPU
the run's ranks got, and :func:`replayed_cores` holds it to the run's own replay in the simulator.

The crowding: when more ranks of a host are busy than it has free cores, the OS time-slices them, and a
slice starts with caches another rank filled: a node then takes more CPU for the same work. On this repository's
CPU bench at pp = 4 (four ranks, two cores) a node's CPU time grew by 2.5-2.9 % per other busy rank,
for 1F1B and interleaved alike; at pp = 2 (a core per rank) it did not grow. A schedule with less
bubble keeps more ranks busy at once and so pays more of it, which node times averaged over a 1F1B run
cannot carry to another schedule. Calibrate therefore fits the share from the run's own nodes
(:func:`fit_contention`), takes node times at no crowding, and the simulator charges it back wherever a
schedule crowds the cores (:mod:`primuspipe.simulator.shared`).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Hashable, Sequence

from primuspipe.calibration.measured import MeasuredCosts, significant
from primuspipe.calibration.replay import executed_table
from primuspipe.calibration.walk import Step, busy_intervals
from primuspipe.io.timeline import Timeline
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.placement import Placement
from primuspipe.simulator import simulate

MIN_NODES = 20
"""Fewer nodes than this fit no contention."""
MIN_SPREAD = 0.1
"""Below this standard deviation of the nodes' excess (in ranks) the run cannot tell contention apart
from the nodes' own times: every node ran about as crowded (e.g. a core per rank)."""
ROUNDS = 8
"""Alternations of the fit (each node group's work, then the common share); it settles in three or four."""


def coverage(intervals: Sequence[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """How many of ``intervals`` cover the time line: the times it changes, and the count holding from
    each to the next (the last is 0).

    >>> coverage([(0, 4), (0, 2), (1, 3)])
    ([0, 1, 2, 3, 4], [2, 3, 2, 1, 0])
    """
    changes = sorted([(a, 1) for a, b in intervals if b > a] + [(b, -1) for a, b in intervals if b > a])
    times: list[float] = []
    levels: list[int] = []
    for t, delta in changes:
        if times and times[-1] == t:
            levels[-1] += delta
        else:
            times.append(t)
            levels.append((levels[-1] if levels else 0) + delta)
    return times, levels


def excess_during(busy: Sequence[tuple[float, float]], windows: Sequence[tuple[float, float]],
                  free: float) -> list[float]:
    """For each ``(start, end)`` window, the mean over it of ``max(0, n(t) - free)``: how many more ranks
    were busy than there were free cores, ``n(t)`` counting the ``busy`` intervals that cover ``t``.

    >>> excess_during([(0, 4), (0, 2), (1, 3)], [(0, 4), (1, 2)], free=1.5)
    [0.625, 1.5]
    """
    times, levels = coverage(busy)
    above = [max(0.0, level - free) for level in levels]
    area = [0.0]  # area[k]: the excess integrated from times[0] to times[k]
    for k in range(len(times) - 1):
        area.append(area[-1] + (times[k + 1] - times[k]) * above[k])

    def integral(t: float) -> float:
        k = bisect.bisect_right(times, t) - 1
        if k < 0:
            return 0.0
        return area[k] + (t - times[k]) * above[k] if k < len(times) - 1 else area[-1]

    return [(integral(b) - integral(a)) / (b - a) if b > a else 0.0 for a, b in windows]


def fit_contention(points: Sequence[tuple[Hashable, float, float]]) -> float | None:
    """The share ``c`` in ``cpu = work[group] * (1 + c * excess)`` from ``(group, excess, cpu)`` per node
    (a group: nodes of one kind and stage, whose work is one value), by least squares, the groups' works
    fitted beside it (alternating rounds). None where the excess hardly varies (:data:`MIN_NODES`,
    :data:`MIN_SPREAD`) or the fit is not positive.

    >>> round(fit_contention([(g, x, w * (1 + 0.05 * x)) for g, w in (("F", 2.0), ("B", 3.0))
    ...                       for x in (0, 0.5, 1, 1.5, 2) * 3]), 9)
    0.05
    """
    if len(points) < MIN_NODES or statistics.pstdev(x for _, x, _ in points) < MIN_SPREAD:
        return None
    share = 0.0
    for _ in range(ROUNDS):
        at_rest: dict[Hashable, list[float]] = defaultdict(list)
        for group, x, cpu in points:
            at_rest[group].append(cpu / (1 + share * x))
        work = {group: statistics.fmean(v) for group, v in at_rest.items()}
        slope, intercept = statistics.linear_regression([x for _, x, _ in points],
                                                        [cpu / work[group] for group, _, cpu in points])
        if intercept <= 0 or slope <= 0:
            return None
        share = slope / intercept
    return share


def effective_cores(timelines: Sequence[Timeline], walks: Sequence[Sequence[Step]]) -> float | None:
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
        for start, end, cpu in busy_intervals(walks[i]):
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
    return significant(round(high, 2))


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
    return significant(round(high, 2))


REPLAY_TOLERANCE = 0.01
"""Relative miss of the replayed step under the CPU fit of the cores beyond which the replay refits them."""

MIN_LONE = 3
"""Fewer nodes run alone than this measure no ``host.speed``."""
ALONE = 0.05
"""A node ran *alone* when other ranks were busy beside it for at most this share of its busy span (on
average, in ranks): a posting of the other rank's does not make it shared."""


def lone_speed(walks: Sequence[Sequence[Step]]) -> float | None:
    """``host.speed``: the median share of a core a rank's thread got over the busy spans of its compute
    nodes (from free to go on to the node's end, :func:`~primuspipe.calibration.walk.busy_intervals`) that
    ran alone (:data:`ALONE`) -- what a rank gets of a core it has to itself. None with fewer than
    :data:`MIN_LONE` such nodes or where they got a whole core.

    A run whose ranks share one host's cores (every rank's events carry CPU times; see
    :func:`effective_cores`), one timeline's walk per iteration."""
    shares = []
    for steps in walks:
        spans = [(s.event.node.kind.is_compute, span) for s in steps for span in busy_intervals([s])]
        busy = [(start, end) for _, (start, end, _) in spans]
        beside = excess_during(busy, busy, free=1)  # the node's own rank is the 1
        shares += [cpu / (end - start) for (compute, (start, end, cpu)), crowd in zip(spans, beside)
                   if compute and crowd <= ALONE and cpu is not None and end > start]
    if len(shares) < MIN_LONE or (speed := statistics.median(shares)) >= 1:
        return None
    return significant(speed)


def _outside_cpu(timeline: Timeline) -> dict[int, float]:
    """Per rank that says it, the CPU its process spent outside its own thread in the step (the
    communication threads that carry its messages, runtime threads)."""
    out = {}
    for facts in timeline.meta.get("ranks", ()):
        if "process_cpu" in facts and "thread_cpu" in facts:
            out[facts["rank"]] = max(0.0, facts["process_cpu"] - facts["thread_cpu"])
    return out


def background_shares(timeline: Timeline) -> list[float]:
    """Per rank that says it, the CPU its process spent outside its own thread over its step's span
    (``RankTimeline.span``): the share of a core ``host.background`` is."""
    spans = {rt.rank: rt.span for rt in timeline.ranks}
    return [cpu / spans[rank] for rank, cpu in _outside_cpu(timeline).items() if spans.get(rank, 0) > 0]


def background_per_message(timelines: Sequence[Timeline]) -> tuple[float, float] | None:
    """``(share of a core, CPU per message)``: each rank's CPU outside its main thread in a step fitted as
    ``share x span + per-message x messages`` (least squares over ranks and steps), where the ranks sent and
    received different numbers of messages for their spans (the middle ranks of 1F1B at pp >= 3 twice the
    end ranks') so the two can be told apart; None where they cannot, or the fit is not positive in both."""
    points = []
    for t in timelines:
        outside, ranks = _outside_cpu(t), {rt.rank: rt for rt in t.ranks}
        points += [(rt.span, rt.messages, cpu) for rank, cpu in outside.items()
                   if (rt := ranks.get(rank)) is not None and rt.span > 0]
    if len({messages for _, messages, _ in points}) < 2 or len({m / s for s, m, _ in points}) < 2:
        return None
    ss = sum(s * s for s, _, _ in points)
    sm = sum(s * m for s, m, _ in points)
    mm = sum(m * m for _, m, _ in points)
    sy = sum(s * y for s, _, y in points)
    my = sum(m * y for _, m, y in points)
    det = ss * mm - sm * sm
    if det <= 1e-12 * ss * mm:
        return None
    share, per_message = (sy * mm - my * sm) / det, (my * ss - sy * sm) / det
    if share <= 0 or per_message <= 1e-9 * max(s for s, _, _ in points):
        return None
    return significant(share), significant(per_message)


def contention_from_walks(walks: Sequence[Sequence[Step]], placement: Placement, free: float):
    """``(contention, per timeline {(rank, node): CPU per unit of work}, nodes fitted)``: each compute
    node's excess -- busy ranks beyond ``free`` cores while it ran, busy as :func:`effective_cores`
    counts it -- against its CPU time, per kind, stage and context (a warm W, a probe window:
    :func:`fit_contention`), over each
    timeline's walk."""
    points, excesses = [], []
    for steps in walks:
        busy = [(start, end) for start, end, _ in busy_intervals(steps)]
        nodes = [s for s in steps
                 if s.event.node.kind.is_compute and s.event.node.pair is None and s.event.cpu is not None]
        excess = excess_during(busy, [(s.event.start, s.event.end) for s in nodes], free)
        excesses.append(dict(zip(((s.rank, s.event.node) for s in nodes), excess)))
        points += [((s.event.node.kind, placement.stage(s.rank, s.event.node.chunk), s.warm, s.window), x,
                    s.event.cpu_time)
                   for s, x in zip(nodes, excess)]  # warm Ws and probe windows are timed apart: groups of their own
    share = fit_contention(points)
    if share is None:
        return None, [{} for _ in walks], 0
    return share, [{key: 1 + share * x for key, x in e.items()} for e in excesses], len(points)


def _levels(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """How many intervals cover the time line, as ``(duration, count)`` pieces."""
    times, counts = coverage(intervals)
    return [(following - t, count) for t, following, count in zip(times, times[1:], counts)]
