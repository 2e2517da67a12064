"""The event loop: replays a full table under a cost model and times every node.

Semantics are the validator's (docs/design.md §3), with time added:

* each rank runs its nodes in table order, one at a time;
* posting a send or a receive takes no rank time and never blocks;
* per direction (source rank -> destination rank) the k-th send is matched with the k-th receive; the
  transfer starts once both are posted (rendezvous, as NCCL's p2p kernels do) and takes
  ``P2PCost.transfer_time`` (links are not contended);
* a compute node starts when its rank is free and its inbound transfers have arrived;
* the step ends when the last node (compute or transfer) finishes.

Because every start time is a function of the table and the costs only, the result does not depend on
the order ranks are visited in; the loop still visits them in a fixed order (a FIFO of woken ranks)
so even its work is reproducible. A compute-only table gets its communication from
:func:`~primuspipe.passes.communication.add_communication` first, so transfers are costed too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property

from primuspipe.passes.communication import add_communication
from primuspipe.ir.dataflow import Transfer, inbound, transfer_of
from primuspipe.errors import SimulationError
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.cost_model import CostModel
from primuspipe.simulator.memory import peak_activations
from primuspipe.ir.table import ScheduleTable
from primuspipe.ir.timeline import RankTimeline, TimedNode, Timeline, idle_share

_COMPUTE, _SEND, _RECV = 0, 1, 2


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

    @property
    def peak_memory_bytes(self) -> float:
        return self.static_bytes + self.peak_activation_bytes

    @property
    def span_bubble_rate(self) -> float:
        """Idle share of this rank's own span, from its first compute start to its last compute end."""
        times = [(s, e) for n, s, e in zip(self.nodes, self.starts, self.ends) if n.kind.is_compute]
        if not times:
            return 0.0
        return idle_share(max(e for _, e in times) - min(s for s, _ in times), self.busy_time)

    @cached_property
    def events(self) -> tuple[TimedNode, ...]:
        return tuple(map(TimedNode, self.nodes, self.starts, self.ends))


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
        ranks = tuple(RankTimeline(r.rank, r.events, round(r.peak_memory_bytes) if modelled else None) for r in self.ranks)
        return Timeline("simulator", t.algorithm, t.pp, t.vpp, t.microbatches, ranks, iteration,
                        self.cost.time_unit, meta)


def simulate(table: ScheduleTable, cost: CostModel) -> SimulationResult:
    """Time ``table`` under ``cost``. Raises :class:`SimulationError` if the table cannot complete
    (run :func:`~primuspipe.passes.validation.validate` on it for the full diagnosis).

    >>> from primuspipe.algorithms.build import build_schedule
    >>> result = simulate(build_schedule("1f1b", pp=8, microbatches=32), CostModel.per_stage(8, f=1, b=1, w=1))
    >>> result.step_time, round(result.bubble_rate, 4)
    (117.0, 0.1795)
    """
    if cost.num_stages != table.num_stages:
        raise SimulationError(f"the cost model describes {cost.num_stages} stages but the table has "
                              f"{table.num_stages} (pp={table.pp} x vpp={table.vpp}); build the costs for this shape")
    full = table if table.has_communication else add_communication(table)
    programs, busy, routes, lanes = _compile(full, cost)
    starts, ends = _run(full, programs, routes, lanes)
    step = max((max(e, default=0.0) for e in ends), default=0.0)
    units, act_bytes = peak_activations(full, cost.memory)
    ranks = tuple(
        RankResult(r, full.ranks[r], tuple(starts[r]), tuple(ends[r]), busy[r],
                   idle_share(step, busy[r]), units[r], act_bytes[r], cost.static_bytes(r))
        for r in range(full.pp)
    )
    return SimulationResult(full, cost, step, ranks)


def _compile(table: ScheduleTable, cost: CostModel) -> tuple[list[list[tuple]], list[float], list[tuple], int]:
    """Per rank, the nodes as flat ops: ``(_COMPUTE, duration, inbound transfer keys)`` or
    ``(_SEND | _RECV, lane, transfer key, transfer time)``; each rank's busy time; the
    ``(carries, src_stage, dst_stage)`` of each transfer key's route; and the number of lanes.

    A transfer is keyed by an int, ``route * microbatches + microbatch``, and everything but the
    microbatch is looked up once per (rank, kind, chunk, peer): this keeps simulate fast enough for
    search loops over large tables.
    """
    placement, m = table.placement, table.microbatches
    lanes: dict[tuple[int, int], int] = {}
    routes: dict[tuple, int] = {}

    def first_key(transfer: Transfer) -> int:
        """The key of the transfer's route at microbatch 0."""
        return routes.setdefault(transfer[:3], len(routes)) * m

    programs, busy = [], []
    for rank, row in enumerate(table.ranks):
        shape: dict[tuple, tuple] = {}  # (kind, chunk, peer, pair chunk) -> (code, duration or lane, keys, time)
        ops, total = [], 0.0
        for node in row:
            mb = node.microbatch
            shape_key = (node.kind, node.chunk, node.peer, node.pair and node.pair[1])
            if (known := shape.get(shape_key)) is None:
                known = shape[shape_key] = _shape(placement, rank, node, cost, lanes, first_key)
            code, value, key0, duration = known
            if code == _COMPUTE:
                # the inbound transfers of each part, at that part's microbatch
                mbs = (mb,) if node.pair is None else (mb, node.pair[0])
                needs = tuple(k + part_mb for k, part_mb in zip(key0, mbs) if k >= 0)
                ops.append((_COMPUTE, value, needs))
                total += value
            else:
                ops.append((code, value, key0 + mb, duration))
        programs.append(ops)
        busy.append(total)
    return programs, busy, list(routes), len(lanes)


def _shape(placement, rank: int, node: ScheduleNode, cost: CostModel, lanes: dict, first_key) -> tuple:
    """What a node of this (rank, kind, chunk, peer) compiles to. A compute node's transfer keys are
    microbatch 0's, one per part (-1 where the part needs no transfer)."""
    kind = node.kind
    if kind.is_compute:
        keys = tuple(-1 if (t := inbound(placement, rank, k, chunk, 0)) is None else first_key(t)
                     for k, _, chunk in node.parts())
        return _COMPUTE, cost.node_time(placement, rank, node), keys, 0.0
    src, dst = (rank, node.peer) if kind.is_send else (node.peer, rank)
    lane = lanes.setdefault((src, dst), len(lanes))
    code = _SEND if kind.is_send else _RECV
    return code, lane, first_key(transfer_of(placement, rank, node)), cost.p2p.transfer_time(src, dst)


def _run(table: ScheduleTable, programs: list[list[tuple]], routes: list[tuple], lanes: int
         ) -> tuple[list[list[float]], list[list[float]]]:
    """The event loop. Returns per-rank start and end times, indexed like the table's rows."""
    pp = len(programs)
    starts = [[0.0] * len(p) for p in programs]
    ends = [[0.0] * len(p) for p in programs]
    posted = [([], []) for _ in range(lanes)]  # per lane: (sends, receives) as [(time, rank, index, transfer)]
    arrival: dict[int, float] = {}  # transfer key -> arrival time
    waiting: dict[int, int] = {}  # transfer key -> the rank blocked on it
    ptr, clock = [0] * pp, [0.0] * pp
    ready = deque(range(pp))
    while ready:
        rank = ready.popleft()
        ops, i, t = programs[rank], ptr[rank], clock[rank]
        st, en = starts[rank], ends[rank]
        while i < len(ops):
            op = ops[i]
            if op[0] == _COMPUTE:
                start = t
                for need in op[2]:
                    a = arrival.get(need)
                    if a is None:
                        break
                    start = a if a > start else start
                else:
                    st[i] = start
                    t = en[i] = start + op[1]
                    i += 1
                    continue
                waiting[need] = rank
                break
            code, lane, transfer, duration = op
            st[i] = t
            sends, recvs = posted[lane]
            mine, theirs = (sends, recvs) if code == _SEND else (recvs, sends)
            mine.append((t, rank, i, transfer))
            k = len(mine) - 1
            if k < len(theirs):
                _match(table, sends[k], recvs[k], duration, ends, arrival)
                if transfer in waiting:
                    ready.append(waiting.pop(transfer))
            i += 1
        ptr[rank], clock[rank] = i, t
    _check_finished(table, programs, ptr, waiting, posted, routes)
    return starts, ends


def _match(table, send: tuple, recv: tuple, duration: float, ends: list[list[float]], arrival: dict) -> None:
    """Pair a lane's k-th send and k-th receive: the transfer starts once both are posted."""
    if send[3] != recv[3]:
        raise SimulationError(
            f"rank {send[1]} node {send[2]} ({table.ranks[send[1]][send[2]]}) is matched with rank "
            f"{recv[1]} node {recv[2]} ({table.ranks[recv[1]][recv[2]]}), which expects another tensor; "
            "run validate(table) and rebuild communication with add_communication")
    done = (send[0] if send[0] > recv[0] else recv[0]) + duration
    ends[send[1]][send[2]] = ends[recv[1]][recv[2]] = arrival[send[3]] = done


def _check_finished(table, programs, ptr, waiting, posted, routes) -> None:
    stuck = [r for r in range(len(programs)) if ptr[r] < len(programs[r])]
    if stuck:
        m = table.microbatches
        blocked = {r: Transfer(*routes[k // m], k % m) for k, r in waiting.items()}
        lines = [f"rank {r} at node {ptr[r]} ({table.ranks[r][ptr[r]]}) waits for the {blocked[r]}" for r in stuck]
        raise SimulationError("the table cannot complete; " + "; ".join(lines)
                              + ". Run validate(table) for the full diagnosis.")
    for sends, recvs in posted:
        if len(sends) != len(recvs):
            extra = (sends if len(sends) > len(recvs) else recvs)[min(len(sends), len(recvs))]
            raise SimulationError(f"rank {extra[1]} node {extra[2]} ({table.ranks[extra[1]][extra[2]]}) is never "
                                  "matched by its peer, so the step cannot complete. Run validate(table) for the full "
                                  "diagnosis.")
