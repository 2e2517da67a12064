"""A run's nodes walked in table order, each with when its rank was ready to start on it: the one view of
a timeline every calibration estimate is read from (host times, waits, busy spans).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from primuspipe.calibration.replay import run_table
from primuspipe.io.timeline import TimedNode, Timeline
from primuspipe.io.timeline_wiring import timed_transfers
from primuspipe.ir.placement import Placement
from primuspipe.ir.row_context import probe_windows, warm_weight_grad


@dataclass(frozen=True)
class Step:
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
    warm: bool = False
    """A warm W (:func:`~primuspipe.ir.row_context.warm_weight_grad`: right after its own B or another W of
    its chunk), which the cost model times apart (``compute.w_warm``)."""
    window: bool = False
    """A node that opens a probe window (:func:`~primuspipe.ir.row_context.probe_windows`: the first to run
    while a deferred W of a rank that otherwise fuses its backwards is pending), whose extra time the cost
    model prices apart (``compute.probe_window``)."""


def walk(timeline: Timeline, placement: Placement) -> Iterator[Step]:
    """Every recorded node of every rank, in table order (the full table the run executed)."""
    table = run_table(timeline, placement)
    wiring = table.wiring
    events = {rt.rank: {e.node: e for e in rt.events} for rt in timeline.ranks}
    rows = [[events.get(rank, {}).get(node) for node in row] for rank, row in enumerate(table.ranks)]
    sent, received = timed_transfers(rows, wiring)
    for rank, row in enumerate(table.ranks):
        free, previous = None, None  # previous: the rank's last compute node in the table
        for node, e, taken, window in zip(row, rows[rank], wiring.takes[rank], probe_windows(row)):
            warm = warm_weight_grad(previous, node)
            if node.kind.is_compute:
                previous = node
            if e is None:
                free = None
                continue
            step = Step(rank, e, free, bool(taken), warm=warm, window=window)
            ends = [(sent.get(key), received.get(key)) for key in taken]
            if free is not None and ends and all(x is not None and r is not None for x, r in ends):
                send, recv = max(ends, key=lambda pair: pair[1].end)
                if recv.end > free[0]:
                    step = replace(step, ready=(recv.end, recv.cpu and recv.cpu[1]), waited=(send, recv),
                                   idle=recv.end - free[0])
            yield step
            free = (e.end, e.cpu and e.cpu[1]) if e.node.kind.is_compute else (e.start, e.cpu and e.cpu[0])


def gap(free: tuple[float, float | None], e: TimedNode, use_cpu: bool) -> float:
    """Host time from the rank being free to this event's start: CPU time where cores were shared."""
    if use_cpu and e.cpu is not None and free[1] is not None:
        return e.cpu[0] - free[1]
    return e.start - free[0]


def busy_intervals(steps: Sequence[Step]) -> list[tuple[float, float, float | None]]:
    """When each rank was busy (see :func:`~primuspipe.calibration.crowding.effective_cores`) over one timeline's walk, with the CPU time
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
