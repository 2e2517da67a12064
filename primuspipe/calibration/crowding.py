"""How crowded the cores were while each node ran, and what it cost: ``host.contention``.

When more ranks of a host are busy than it has free cores, the OS time-slices them, and a slice starts
with caches another rank filled: a node then takes more CPU for the same work. On this repository's
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
