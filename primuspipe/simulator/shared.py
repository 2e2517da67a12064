"""The event loop for ranks sharing cores (``host.cores`` per node of ``p2p.ranks_per_node`` ranks).

Processor sharing: while ``n`` CPU jobs of a node are running each progresses at ``min(speed, free / n)``
of a core, ``free`` being the node's cores less what its ranks' processes keep busy outside their main
threads (``host.background`` each, and ``host.message_cpu`` per message spread over the step), ``speed``
what a rank gets of a core it has to itself (``host.speed``);
and while more jobs run than there are free cores, a job needs ``1 + contention * (n - free)`` times its
work in CPU (``host.contention``: the cache refills of time slicing), so its work progresses that much
slower than its CPU. A rank's host time and compute are jobs
of its node (:class:`Job`). Time passes for all ranks together: the next event is the earliest job
completion (tracked per node in *virtual time*, the work a job running since the start would have done,
beside the CPU it would have had), transfer arrival or rank entering the step. Also returns, per rank
and node, the CPU time the rank had got by the node's start and end.

A compute node is reported as an OS time-slicing ranks shows it in a run's dump: ending when its work
is done, lasting its work (a rank holds its core through a node and waits for one between nodes), so
busy time is work and the time spent sharing is idle time before the node.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from typing import NamedTuple

from primuspipe.errors import SimulationError
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.streams import Semantics
from primuspipe.simulator.program import Compute, Copy, Post, Program
from primuspipe.simulator.transport import StreamClock, Wires
from primuspipe.simulator.unfinished import check_finished


# at most: the step and the cores host.message_cpu leaves settle to 1e-6 in 3-5 rounds on the bench's files
_MESSAGE_ROUNDS = 8


class Job(enum.Enum):
    """What the job a rank is running does; when it finishes, the rank goes on accordingly."""
    POSTING = "the host time of posting its current op (a send or receive), which is posted when it ends"
    BEFORE_COMPUTE = "the host time before its current compute op, whose work starts when it ends"
    WORK = "the work of its current compute op, which ends when it does"


class Entry(NamedTuple):
    """A rank entering the step at ``time`` (its step offset), queued with the transfer arrivals
    (``(time, transfer key, slot, partner slot)`` from :meth:`StreamClock.post`). ``order`` is
    ``-1 - rank``: at one time, entries come before arrivals (whose keys are >= 0), later ranks first."""
    time: float
    order: int
    rank: int


def run_shared(table: ScheduleTable, programs: list[Program], wires: Wires, offsets: list[float],
               semantics: Semantics, *, cost: CostModel):
    """Per rank, the start and end time of every node and the CPU time the rank had got by each node's
    start and end; rank ``r`` enters the step at ``offsets[r]``."""
    if any(type(op) is Copy for program in programs for op in program.ops):
        raise SimulationError("host copies (OFFLOAD/RELOAD) are not modelled with ranks sharing cores (host.cores); "
                              "simulate the offloaded table with a cost model without host.cores")
    loop = _SharedCores(programs, wires, offsets, cost)
    loop.run()
    posts = [sum(type(op) is Post for op in program.ops) for program in programs]
    if cost.host.message_cpu and any(posts):
        # each message's CPU off the main thread, spread over the step like host.background: the step
        # depends on the cores that leaves, so settle the two together (a few rounds converge)
        for _ in range(_MESSAGE_ROUNDS):
            step = loop.step_span()
            taken = [0.0] * loop.nodes
            for rank, n in enumerate(loop.node_of):
                taken[n] += cost.host.message_cpu * posts[rank] / step
            loop = _SharedCores(programs, wires, offsets, cost, taken)
            loop.run()
            if abs(loop.step_span() - step) <= 1e-6 * step:  # far below any measured step's spread
                break
    check_finished(table, programs, loop.at, loop.waiting, loop.streams, semantics)
    return loop.starts, loop.ends, [[tuple(c) for c in row] for row in loop.cpu]


class _SharedCores:
    """The loop's state; :meth:`run` runs the step."""

    def __init__(self, programs: list[Program], wires: Wires, offsets: list[float], cost: CostModel,
                 message_cores: list[float] | None = None):
        pp, per_node = len(programs), cost.p2p.ranks_per_node
        self.programs, self.wires, self.offsets = programs, wires, offsets
        self.contention, self.speed = cost.host.contention, cost.host.speed
        self.node_of = node_of = [r // per_node for r in range(pp)]
        self.nodes = nodes = node_of[-1] + 1 if pp else 0
        taken = message_cores or [0.0] * nodes  # per node: the share of cores its ranks' messages take
        self.free = [cost.host.cores - cost.host.background * node_of.count(n) - taken[n] for n in range(nodes)]
        if any(f <= 0 for f in self.free):
            raise SimulationError(f"{cost.source or 'cost model'}: host.background ({cost.host.background:g} of a core "
                                  f"per rank) with host.message_cpu "
                                  f"({cost.host.message_cpu:g} per message) leaves no core free on a node of "
                                  f"{max(map(node_of.count, range(nodes)))} ranks sharing host.cores "
                                  f"({cost.host.cores:g}); lower host.background or host.message_cpu or raise "
                                  "host.cores")
        # per node: its work clock (virtual time), its CPU clock, how many jobs run, and a heap of
        # (virtual finish, sequence, rank) of its running jobs
        self.virtual, self.spent, self.active = [0.0] * nodes, [0.0] * nodes, [0] * nodes
        self.jobs: list[list[tuple[float, int, int]]] = [[] for _ in range(nodes)]
        self.arrivals: list[tuple] = []  # heap of transfer arrivals and Entry
        self.starts = [[0.0] * len(p.ops) for p in programs]
        self.ends = [[0.0] * len(p.ops) for p in programs]
        self.streams = StreamClock(wires, self.ends)
        self.arrived: set[int] = set()
        self.waiting: dict[int, int] = {}  # transfer key -> the rank blocked on it
        self.at = [0] * pp  # per rank: the op it is at
        self.doing: list[Job | None] = [None] * pp  # per rank: the job it runs (while it runs one)
        self.seq, self.now = itertools.count(), 0.0
        self.got = [0.0] * pp  # CPU time each rank's finished jobs took
        self.running: dict[int, float] = {}  # rank -> its node's CPU clock (spent) when its running job started
        self.cpu = [[[0.0, 0.0] for _ in p.ops] for p in programs]  # per rank and node: CPU got by its start, end

    def cpu_now(self, rank: int) -> float:
        started = self.running.get(rank)
        return self.got[rank] + (0.0 if started is None else self.spent[self.node_of[rank]] - started)

    def share(self, n: int) -> float:
        """The share of a core each running job of node ``n`` gets."""
        return self.speed if self.active[n] <= self.free[n] else min(self.speed, self.free[n] / self.active[n])

    def slowdown(self, n: int) -> float:
        """CPU per unit of work of node ``n``'s jobs."""
        return 1.0 + self.contention * max(0.0, self.active[n] - self.free[n])

    def rate(self, n: int) -> float:
        return self.share(n) / self.slowdown(n)

    def start_job(self, rank: int, work: float, job: Job) -> None:
        n = self.node_of[rank]
        heapq.heappush(self.jobs[n], (self.virtual[n] + work, next(self.seq), rank))
        self.active[n] += 1
        self.running[rank] = self.spent[n]
        self.doing[rank] = job

    def advance(self, rank: int) -> None:
        """Run ``rank`` from its current op until it starts a job or waits for a transfer."""
        (ops, needs, _), i = self.programs[rank], self.at[rank]
        while i < len(ops):
            op = ops[i]
            if type(op) is Compute:
                missing = [need for need in needs[i] if need not in self.arrived]
                if missing:
                    self.waiting[missing[0]] = rank
                    break
                self.at[rank] = i
                if op.host > 0:
                    self.start_job(rank, op.host, Job.BEFORE_COMPUTE)
                else:
                    self.begin_work(rank, i)
                return
            if op.host > 0:  # spend its post time first
                self.at[rank] = i
                self.start_job(rank, op.host, Job.POSTING)
                return
            self.post(rank, i)
            i += 1
        self.at[rank] = i

    def begin_work(self, rank: int, i: int) -> None:
        self.starts[rank][i] = self.now
        self.cpu[rank][i][0] = self.got[rank]
        duration = self.programs[rank].ops[i].duration
        if duration > 0:
            self.start_job(rank, duration, Job.WORK)
        else:
            self.end_work(rank, i)

    def end_work(self, rank: int, i: int) -> None:
        # drawn as the OS runs it: the CPU it took at full speed, ending now, after waiting for a core
        self.starts[rank][i], self.ends[rank][i] = self.now - (self.got[rank] - self.cpu[rank][i][0]), self.now
        self.cpu[rank][i][1] = self.got[rank]
        self.at[rank] = i + 1
        self.advance(rank)

    def post(self, rank: int, i: int) -> None:
        op: Post = self.programs[rank].ops[i]
        self.starts[rank][i] = self.now
        self.cpu[rank][i][0] = self.got[rank]
        for completed in self.streams.post(self.programs[rank].slots[i], self.now, op.transfer_time):
            heapq.heappush(self.arrivals, completed)

    def step_span(self) -> float:
        """From the first rank's entry to the last node's end (after :meth:`run`)."""
        return max(max(e, default=o) for e, o in zip(self.ends, self.offsets)) - min(self.offsets, default=0.0)

    def run(self) -> None:
        for rank, offset in enumerate(self.offsets):
            heapq.heappush(self.arrivals, Entry(offset, -1 - rank, rank))
        jobs, virtual, spent, active, nodes = self.jobs, self.virtual, self.spent, self.active, self.nodes
        while True:
            best, node = math.inf, -1  # the next event's time, and the node whose job ends then (-1: an arrival)
            for n in range(nodes):
                if jobs[n]:
                    t = self.now + (jobs[n][0][0] - virtual[n]) / self.rate(n)
                    if t < best:
                        best, node = t, n
            if self.arrivals and self.arrivals[0][0] <= best:
                best, node = self.arrivals[0][0], -1
            if best == math.inf:
                break
            for n in range(nodes):
                if active[n]:
                    work = (best - self.now) * self.rate(n)
                    virtual[n] += work
                    spent[n] += work * self.slowdown(n)
            self.now = best
            if node < 0:
                self.arrive(heapq.heappop(self.arrivals))
            else:
                self.finish_job(node)

    def arrive(self, event: tuple) -> None:
        if type(event) is Entry:
            self.advance(event.rank)
            return
        _, transfer, slot, partner = event
        for end in (slot, partner):
            end_rank, end_index = self.wires.where[end]
            self.cpu[end_rank][end_index][1] = self.cpu_now(end_rank)
        self.arrived.add(transfer)
        if transfer in self.waiting:
            self.advance(self.waiting.pop(transfer))

    def finish_job(self, node: int) -> None:
        finish, _, rank = heapq.heappop(self.jobs[node])
        self.spent[node] += (finish - self.virtual[node]) * self.slowdown(node)
        self.virtual[node], self.active[node] = finish, self.active[node] - 1
        self.got[rank] += self.spent[node] - self.running.pop(rank)
        i, job = self.at[rank], self.doing[rank]
        self.doing[rank] = None
        if job is Job.POSTING:
            self.post(rank, i)
            self.at[rank] = i + 1
            self.advance(rank)
        elif job is Job.BEFORE_COMPUTE:
            self.begin_work(rank, i)
        else:
            self.end_work(rank, i)
