"""The event loop: replays a full table under a cost model and times every node.

Semantics are the validator's (docs/design.md §3), with time added (docs/simulator.md):

* each rank runs its nodes in table order, one at a time;
* posting a send or a receive takes the host's post time (``host.send`` / ``host.recv``, default 0)
  and never blocks the rank;
* per direction (source rank -> destination rank) the k-th send is matched with the k-th receive; each
  runs on its rank's stream of the transport ``semantics`` (:mod:`primuspipe.simulator.transport`):
  once posted and the stream's previous item completed; the transfer starts once both ends run
  (rendezvous, as NCCL's p2p kernels do) and takes ``P2PCost.transfer_time`` (links are not contended,
  but a stream is serial: a transfer waiting on its peer delays the next one on its stream);
* a compute node starts when its rank is free and its inbound transfers have arrived, plus its kind's
  host overhead; it takes its cost, plus its cold start when it is its chunk's first of its kind in the step;
* OFFLOAD / RELOAD copy on the rank's copy streams, overlapping compute
  (:mod:`primuspipe.simulator.host_copies`);
* the step ends when the last node (compute or transfer) finishes.

Ranks with a device each (``host.cores`` unset) never slow each other, so each rank is run as far as
it can go before the next (:func:`_run_dedicated`), and because every start time is a function of the
table and the costs only, the result does not depend on that order. Ranks sharing cores
(``host.cores``) slow each other while more of them are busy than there are cores, so time must pass
for all of them together (:func:`_run_shared`). A compute-only table gets its communication from
:func:`~primuspipe.passes.communication.add_communication` first, so transfers are costed too.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from functools import cached_property

from primuspipe.passes.communication import add_communication
from primuspipe.passes.streams import DEFAULT_SEMANTICS, Semantics, replay, semantics_named
from primuspipe.errors import SimulationError
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.cost_model import CostModel
from primuspipe.simulator import host_copies
from primuspipe.simulator.memory import peak_activations
from primuspipe.simulator.transport import StreamClock, Wires
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.timeline import RankTimeline, TimedNode, Timeline, idle_share

_COMPUTE, _SEND, _RECV, _COPY = 0, 1, 2, 3
_STEADY_STATE_ROUNDS = 50
"""With step gaps, steps are replayed until each rank enters the step at the same offset as in the
previous one (a pipeline settles in a few rounds); at most this many."""


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
                            process_cpu=thread + self.cost.host.background * rt.span)
        if len(facts[0]) > 1:
            meta["ranks"] = facts
        return Timeline("simulator", t.algorithm, t.pp, t.vpp, t.microbatches, ranks, iteration,
                        self.cost.time_unit, meta)


def simulate(table: ScheduleTable, cost: CostModel,
             semantics: Semantics | str = DEFAULT_SEMANTICS) -> SimulationResult:
    """Time ``table`` under ``cost``, its sends and receives running on the streams of the transport
    ``semantics`` (:mod:`primuspipe.passes.streams`; default primuspipe's own transport, what the runner
    runs). Raises :class:`SimulationError` if the table cannot complete under them (naming the cycle of
    waits; ``primuspipe validate --semantics NAME`` gives the full diagnosis).

    >>> from primuspipe.algorithms.build import build_schedule
    >>> result = simulate(build_schedule("1f1b", pp=8, microbatches=32), CostModel.per_stage(8, f=1, b=1, w=1))
    >>> result.step_time, round(result.bubble_rate, 4)
    (117.0, 0.1795)
    """
    if cost.num_stages != table.num_stages:
        raise SimulationError(f"the cost model describes {cost.num_stages} stages but the table has "
                              f"{table.num_stages} (pp={table.pp} x vpp={table.vpp}); build the costs for this shape")
    gaps = cost.host.step_gap
    if gaps is not None and len(gaps) != table.pp:
        raise SimulationError(f"host.step_gap has {len(gaps)} values but the table has {table.pp} ranks; give one "
                              "number or one per rank")
    if isinstance(semantics, str):
        semantics = semantics_named(semantics)
    full = table if table.has_communication else add_communication(table)
    wires = Wires(full, semantics)
    programs = _compile(full, cost, wires)
    offsets = [0.0] * full.pp
    for _ in range(1 if gaps is None else _STEADY_STATE_ROUNDS):
        if cost.host.cores is None:
            (starts, ends), cpu = _run_dedicated(full, programs, wires, offsets, semantics), None
        else:
            starts, ends, cpu = _run_shared(full, programs, wires, offsets, semantics, cost=cost)
        if gaps is None:
            break
        # the next step: each rank starts its step gap after its own end
        nxt = [max(e, default=o) + g for e, o, g in zip(ends, offsets, gaps)]
        nxt = [x - min(nxt) for x in nxt]
        if all(abs(a - b) <= 1e-12 * (1 + abs(a)) for a, b in zip(nxt, offsets)):
            break
        offsets = nxt
    step = max((max(e, default=0.0) for e in ends), default=0.0)
    busy = [sum(op[2] for op in ops if op[0] == _COMPUTE) for ops in programs]
    period = None if gaps is None else min(max(e, default=o) + g - o for e, o, g in zip(ends, offsets, gaps))
    units, act_bytes = peak_activations(full, cost.memory, starts, ends)
    ranks = tuple(
        RankResult(r, full.ranks[r], tuple(starts[r]), tuple(ends[r]), busy[r],
                   idle_share(step, busy[r]), units[r], act_bytes[r], cost.static_bytes(r),
                   None if cpu is None else tuple(cpu[r]), offsets[r])
        for r in range(full.pp)
    )
    return SimulationResult(full, cost, step, ranks, period)


def _compile(table: ScheduleTable, cost: CostModel, wires: Wires) -> list[list[tuple]]:
    """Per rank, the nodes as flat ops. An op is ``(_COMPUTE, host time before it, duration, inbound
    transfer keys)`` or ``(_SEND | _RECV, host time to post it, slot in ``wires``, transfer key, transfer
    time)`` or ``(_COPY, copy stream, copy time, reload key or None)``; keys are the table's
    :class:`~primuspipe.ir.dataflow.Wiring`.

    A compute node waits for its inbound transfers only, though the runner also completes there the
    earlier send its input proves delivered (:func:`~primuspipe.ir.dataflow.released_transfer`): that
    send completed together with its receive, which the peer waited for before producing this input,
    so the wait never delays it (tests/simulator/test_transport.py checks this on the shipped tables).

    Everything but the microbatch is looked up once per (rank, kind, chunk, peer): this keeps simulate
    fast enough for search loops over large tables.
    """
    placement, wiring = table.placement, table.wiring
    programs = []
    for rank, (row, moves, takes, slots) in enumerate(zip(table.ranks, wiring.moves, wiring.takes, wires.slots)):
        shapes: dict[tuple, tuple] = {}  # (kind, chunk, peer, pair chunk) -> the op less its microbatch
        warmed: set[tuple] = set()  # (kind, chunk) whose first node of the step has run
        reloads = host_copies.reloaded(table, rank)
        ops = []
        for node, moved, needs, slot in zip(row, moves, takes, slots):
            kind = node.kind
            if kind.on_host_stream:
                key = host_copies.reload_key(rank, node.chunk, node.microbatch, table) if kind is NodeKind.RELOAD else None
                ops.append((_COPY, host_copies.copy_stream(kind), cost.copy_time(placement.stage(rank, node.chunk)), key))
                continue
            shape_key = (kind, node.chunk, node.peer, node.pair and node.pair[1])
            if (known := shapes.get(shape_key)) is None:
                known = shapes[shape_key] = _shape(placement, rank, node, cost)
            if moved >= 0:
                ops.append((known[0], known[1], slot, moved, known[2]))
                continue
            duration = known[2]
            if cost.cold_start is not None and (first := [p for p in node.parts() if (p.kind, p.chunk) not in warmed]):
                warmed.update((p.kind, p.chunk) for p in first)
                duration += cost.cold_start_time([(p.kind, placement.stage(rank, p.chunk)) for p in first])
            if reloads:
                needs = (*needs, *host_copies.waits_for_reload(table, rank, node, reloads))
            ops.append((_COMPUTE, known[1], duration, needs))
        programs.append(ops)
    return programs


def _shape(placement, rank: int, node: ScheduleNode, cost: CostModel) -> tuple:
    """What a node of this (rank, kind, chunk, peer) compiles to, less its microbatch:
    ``(_COMPUTE, host time, duration)`` or ``(code, host time, transfer time)``."""
    kind = node.kind
    if kind.is_compute:
        return _COMPUTE, cost.host.before(kind), cost.node_time(placement, rank, node)
    src, dst = (rank, node.peer) if kind.is_send else (node.peer, rank)
    return _SEND if kind.is_send else _RECV, cost.host.post(kind), cost.p2p.transfer_time(src, dst)


def _run_dedicated(table: ScheduleTable, programs: list[list[tuple]], wires: Wires, offsets: list[float],
                   semantics: Semantics):
    """The event loop for ranks with a device each: every rank runs as far as it can, then waits for a
    transfer; an arrival wakes its consumer. Rank ``r`` enters the step at ``offsets[r]``. Returns
    per-rank start and end times (indexed like the table's rows)."""
    pp = len(programs)
    starts = [[0.0] * len(p) for p in programs]
    ends = [[0.0] * len(p) for p in programs]
    streams = StreamClock(wires, ends)
    arrival: dict[int, float] = {}  # transfer key -> arrival time
    waiting: dict[int, int] = {}  # transfer key -> the rank blocked on it
    ptr, clock = [0] * pp, list(offsets)
    copies_free = [[0.0, 0.0] for _ in range(pp)]  # per rank: when each copy stream is free
    ready = deque(range(pp))
    while ready:
        rank = ready.popleft()
        ops, i, t = programs[rank], ptr[rank], clock[rank]
        st, en = starts[rank], ends[rank]
        while i < len(ops):
            op = ops[i]
            if op[0] == _COMPUTE:
                start = t
                for need in op[3]:
                    a = arrival.get(need)
                    if a is None:
                        break
                    start = a if a > start else start
                else:
                    st[i] = start = start + op[1]
                    t = en[i] = start + op[2]
                    i += 1
                    continue
                waiting[need] = rank
                break
            if op[0] == _COPY:
                _, stream, duration, key = op
                st[i] = start = max(t, copies_free[rank][stream])
                en[i] = copies_free[rank][stream] = start + duration
                if key is not None:
                    arrival[key] = en[i]
                i += 1
                continue
            t += op[1]
            st[i] = t
            for done, transfer, _, _ in streams.post(op[2], t, op[4]):
                arrival[transfer] = done
                if transfer in waiting:
                    ready.append(waiting.pop(transfer))
            i += 1
        ptr[rank], clock[rank] = i, t
    _check_finished(table, programs, ptr, waiting, streams, semantics)
    return starts, ends


def _run_shared(table: ScheduleTable, programs: list[list[tuple]], wires: Wires, offsets: list[float],
                semantics: Semantics, *, cost: CostModel):
    """The event loop for ranks sharing ``host.cores`` cores per node (``p2p.ranks_per_node`` ranks):
    processor sharing, i.e. while ``n`` CPU jobs of a node are running each progresses at
    ``min(1, free / n)`` of a core, ``free`` being the node's cores less what its ranks' processes keep
    busy outside their main threads (``host.background`` each); and while more jobs run than there are
    free cores, a job needs ``1 + contention * (n - free)`` times its work in CPU (``host.contention``:
    the cache refills of time slicing), so its work progresses that much slower than its CPU. A rank's
    host time and compute are jobs of its node. Time passes for all ranks together: the next event is
    the earliest job completion (tracked per node in *virtual time*, the work a job running since the
    start would have done, beside the CPU it would have had) or transfer arrival. Also returns, per
    rank and node, the CPU time the rank had got by the node's start and end.

    A compute node is reported as an OS time-slicing ranks shows it in a run's dump: ending when its
    work is done, lasting its work (a rank holds its core through a node and waits for one between
    nodes), so busy time is work and the time spent sharing is idle time before the node."""
    if any(op[0] == _COPY for ops in programs for op in ops):
        raise SimulationError("host copies (OFFLOAD/RELOAD) are not modelled with ranks sharing cores (host.cores); "
                              "simulate the offloaded table with a cost model without host.cores")
    pp, per_node = len(programs), cost.p2p.ranks_per_node
    node_of = [r // per_node for r in range(pp)]
    nodes = node_of[-1] + 1 if pp else 0
    free = [cost.host.cores - cost.host.background * node_of.count(n) for n in range(nodes)]
    if any(f <= 0 for f in free):
        raise SimulationError(f"host.background ({cost.host.background:g} of a core per rank) leaves no core free on "
                              f"a node of {max(map(node_of.count, range(nodes)))} ranks sharing host.cores "
                              f"({cost.host.cores:g}); lower host.background or raise host.cores")
    virtual, spent, active = [0.0] * nodes, [0.0] * nodes, [0] * nodes  # per node: work and CPU clocks
    jobs: list[list[tuple]] = [[] for _ in range(nodes)]  # per node: heap of (virtual finish, seq, rank, phase)
    arrivals: list[tuple[float, int]] = []  # heap of (time, transfer key)
    starts = [[0.0] * len(p) for p in programs]
    ends = [[0.0] * len(p) for p in programs]
    streams = StreamClock(wires, ends)
    arrived: set[int] = set()
    waiting: dict[int, int] = {}
    ptr, seq, now = [0] * pp, itertools.count(), 0.0
    got = [0.0] * pp  # CPU time each rank's finished jobs took
    running: dict[int, float] = {}  # rank -> its node's CPU clock (spent) when its running job started
    cpu = [[[0.0, 0.0] for _ in p] for p in programs]
    _HOST, _WORK = 0, 1

    def cpu_now(rank: int) -> float:
        started = running.get(rank)
        return got[rank] + (0.0 if started is None else spent[node_of[rank]] - started)

    def share(n: int) -> float:
        """The share of a core each running job of node ``n`` gets."""
        return 1.0 if active[n] <= free[n] else free[n] / active[n]

    def slowdown(n: int) -> float:
        """CPU per unit of work of node ``n``'s jobs."""
        return 1.0 + cost.host.contention * max(0.0, active[n] - free[n])

    def rate(n: int) -> float:
        return share(n) / slowdown(n)

    def start_job(n: int, work: float, rank: int, phase: int) -> None:
        heapq.heappush(jobs[n], (virtual[n] + work, next(seq), rank, phase))
        active[n] += 1
        running[rank] = spent[n]

    def advance(rank: int) -> None:
        """Run ``rank`` from its current op until it starts a job or waits for a transfer."""
        ops, i = programs[rank], ptr[rank]
        while i < len(ops):
            op = ops[i]
            if op[0] == _COMPUTE:
                missing = [need for need in op[3] if need not in arrived]
                if missing:
                    waiting[missing[0]] = rank
                    break
                ptr[rank] = i
                if op[1] > 0:
                    start_job(node_of[rank], op[1], rank, _HOST)
                else:
                    begin_work(rank, i)
                return
            if op[1] > 0:  # spend its post time first; ptr = ~i marks "posting op i"
                ptr[rank] = ~i
                start_job(node_of[rank], op[1], rank, _HOST)
                return
            post(rank, i, op)
            i += 1
        ptr[rank] = i

    def begin_work(rank: int, i: int) -> None:
        starts[rank][i] = now
        cpu[rank][i][0] = got[rank]
        duration = programs[rank][i][2]
        if duration > 0:
            start_job(node_of[rank], duration, rank, _WORK)
        else:
            end_work(rank, i)

    def end_work(rank: int, i: int) -> None:
        # drawn as the OS runs it: the CPU it took at full speed, ending now, after waiting for a core
        starts[rank][i], ends[rank][i] = now - (got[rank] - cpu[rank][i][0]), now
        cpu[rank][i][1] = got[rank]
        ptr[rank] = i + 1
        advance(rank)

    def post(rank: int, i: int, op: tuple) -> None:
        starts[rank][i] = now
        cpu[rank][i][0] = got[rank]
        for completed in streams.post(op[2], now, op[4]):
            heapq.heappush(arrivals, completed)

    for rank in range(pp):  # a rank entering the step later arrives like a transfer (key ~rank)
        heapq.heappush(arrivals, (offsets[rank], ~rank))
    while True:
        best, node = math.inf, -1
        for n in range(nodes):
            if jobs[n]:
                t = now + (jobs[n][0][0] - virtual[n]) / rate(n)
                if t < best:
                    best, node = t, n
        if arrivals and arrivals[0][0] <= best:
            best, node = arrivals[0][0], -1
        if best == math.inf:
            break
        for n in range(nodes):
            if active[n]:
                work = (best - now) * rate(n)
                virtual[n] += work
                spent[n] += work * slowdown(n)
        now = best
        if node < 0:
            _, transfer, *slots = heapq.heappop(arrivals)
            if not slots:
                advance(~transfer)
                continue
            for slot in slots:
                end_rank, end_index = wires.where[slot]
                cpu[end_rank][end_index][1] = cpu_now(end_rank)
            arrived.add(transfer)
            if transfer in waiting:
                advance(waiting.pop(transfer))
            continue
        finish, _, rank, phase = heapq.heappop(jobs[node])
        spent[node] += (finish - virtual[node]) * slowdown(node)
        virtual[node], active[node] = finish, active[node] - 1
        got[rank] += spent[node] - running.pop(rank)
        i = ptr[rank]
        if i < 0:  # a post's host time is spent: post it now
            post(rank, ~i, programs[rank][~i])
            ptr[rank] = ~i + 1
            advance(rank)
        elif phase == _HOST:
            begin_work(rank, i)
        else:
            end_work(rank, i)
    _check_finished(table, programs, ptr, waiting, streams, semantics)
    return starts, ends, [[tuple(c) for c in row] for row in cpu]


def _check_finished(table, programs, ptr, waiting, streams: StreamClock, semantics: Semantics) -> None:
    """Refuse a step some rank or transfer never finished, with the validator's cycle of waits."""
    stuck = [r for r in range(len(programs)) if ptr[r] < len(programs[r])]
    unfinished = streams.incomplete()
    if not stuck and not unfinished:
        return
    blocked = {r: host_copies.describe_key(k, table) if k < 0 else table.wiring.transfer(k) for k, r in waiting.items()}
    lines = [f"rank {r} at node {ptr[r]} ({table.ranks[r][ptr[r]]}) waits for the {blocked[r]}" for r in stuck]
    lines += [f"rank {r} node {i} ({table.ranks[r][i]}) never completes" for r, i in unfinished[:3] if r not in stuck]
    hang = replay(table, semantics)
    cycle = "" if hang is None else " The operations wait on each other in a cycle: " + "; ".join(hang.chain) + "."
    raise SimulationError(f"the table cannot complete under the {semantics.name} transport semantics; "
                          + "; ".join(lines) + "." + cycle + " Run validate(table, semantics="
                          f"{semantics.name!r}) or `primuspipe validate FILE --semantics {semantics.name}` on the "
                          "exported table for the full diagnosis.")
