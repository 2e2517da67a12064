"""The event loop for ranks with a device each (``host.cores`` unset): ranks never slow each other, so
each runs as far as it can before the next, and an arrival wakes the rank waiting for it. Every start
time is a function of the table and the costs only, so the result does not depend on that order."""

from __future__ import annotations

from collections import deque

from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.streams import Semantics
from primuspipe.simulator.program import Compute, Copy, Program
from primuspipe.simulator.transport import StreamClock, Wires
from primuspipe.simulator.unfinished import check_finished


def run_dedicated(table: ScheduleTable, programs: list[Program], wires: Wires, offsets: list[float],
                  semantics: Semantics) -> tuple[list[list[float]], list[list[float]]]:
    """Per rank, the start and end time of every node (indexed like the table's rows); rank ``r`` enters
    the step at ``offsets[r]``."""
    pp = len(programs)
    starts = [[0.0] * len(p.ops) for p in programs]
    ends = [[0.0] * len(p.ops) for p in programs]
    streams = StreamClock(wires, ends)
    arrival: dict[int, float] = {}  # transfer or reload key -> arrival time
    waiting: dict[int, int] = {}  # key -> the rank blocked on it
    at, clock = [0] * pp, list(offsets)  # per rank: the op it is at, and when it is free
    copies_free = [[0.0, 0.0] for _ in range(pp)]  # per rank: when each copy stream is free
    ready = deque(range(pp))
    while ready:
        rank = ready.popleft()
        (ops, needs, slots), i, t = programs[rank], at[rank], clock[rank]
        st, en = starts[rank], ends[rank]
        while i < len(ops):
            op = ops[i]
            if type(op) is Compute:
                start = t
                for need in needs[i]:
                    a = arrival.get(need)
                    if a is None:
                        break
                    start = a if a > start else start
                else:
                    st[i] = start = start + op.host
                    t = en[i] = start + op.duration
                    i += 1
                    continue
                waiting[need] = rank
                break
            if type(op) is Copy:
                free = copies_free[rank]
                st[i] = start = max(t, free[op.stream])
                en[i] = free[op.stream] = start + op.duration
                if op.reload is not None:
                    arrival[op.reload] = en[i]
                i += 1
                continue
            t += op.host  # a Post
            st[i] = t
            for done, transfer, _, _ in streams.post(slots[i], t, op.transfer_time):
                arrival[transfer] = done
                if transfer in waiting:
                    ready.append(waiting.pop(transfer))
            i += 1
        at[rank], clock[rank] = i, t
    check_finished(table, programs, at, waiting, streams, semantics)
    return starts, ends
