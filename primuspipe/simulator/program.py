"""A rank's nodes compiled for the event loops: named op records, costs looked up once.

Three records, one per thing a rank does: :class:`Compute` (host time, then its kernels, once its inbound
transfers have arrived), :class:`Post` (a send or a receive: host time to post it, then the transfer runs
on the transport's streams, :mod:`primuspipe.simulator.transport`) and :class:`Copy` (an OFFLOAD or
RELOAD on a copy stream, :mod:`primuspipe.simulator.host_copies`). A record holds what a node costs, so
the nodes of one (kind, chunk, peer) share one record; what is each node's own -- the keys it waits for,
its transfer's slot -- is in :class:`Program`'s per-node lists beside it. Transfer keys are the table's
:class:`~primuspipe.ir.dataflow.Wiring`; reload keys are negative (:func:`~primuspipe.simulator.host_copies.reload_key`).

Sharing records is also what keeps compiling cheap: a record is a tuple subclass, which Python's garbage
collector tracks for its whole life (a plain tuple of numbers it stops tracking), and a table of 10^5
nodes with one record each made every full collection walk them all.
"""

from __future__ import annotations

from typing import NamedTuple

from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.row_context import window_openings, warm_weight_grad
from primuspipe.ir.table import ScheduleTable
from primuspipe.simulator import host_copies
from primuspipe.simulator.transport import Wires


class Compute(NamedTuple):
    """A compute node: the rank spends ``host`` (its kind's host overhead), then ``duration`` (its cost
    -- a W's by whether it runs warm, :func:`~primuspipe.ir.row_context.warm_weight_grad`, any node's by
    whether it opens a window of deferred Ws, :func:`~primuspipe.ir.row_context.window_openings` -- plus its cold start
    when it is its chunk's first of its kind in the step), once the keys it needs
    (:attr:`Program.needs`: inbound transfers, reloads) have arrived."""
    host: float
    duration: float


class Post(NamedTuple):
    """A send or a receive: the rank spends ``host`` posting it, then never blocks; its operation
    (:attr:`Program.slots`) runs on its stream and the transfer takes ``transfer_time``."""
    host: float
    transfer_time: float


class Copy(NamedTuple):
    """An OFFLOAD or RELOAD: issued in table order, it runs on the rank's copy stream ``stream`` for
    ``duration``; a reload's end is the arrival of key ``reload`` (None for an offload)."""
    stream: int
    duration: float
    reload: int | None


Op = Compute | Post | Copy


class Program(NamedTuple):
    """One rank's nodes, in table order: per node its op record, the keys it waits for (a compute
    node's; empty for the others) and its slot in :class:`~primuspipe.simulator.transport.Wires` (-1
    but for a send or receive)."""
    ops: list[Op]
    needs: list[tuple[int, ...]]
    slots: list[int]


def compile_programs(table: ScheduleTable, cost: CostModel, wires: Wires) -> list[Program]:
    """Per rank, its :class:`Program`.

    A compute node waits for its inbound transfers only, though the runner also completes there the
    earlier send its input proves delivered (:func:`~primuspipe.ir.dataflow.released_transfer`): that
    send completed together with its receive, which the peer waited for before producing this input,
    so the wait never delays it (tests/simulator/test_transport.py checks this on the shipped tables).

    Everything but the microbatch is looked up once per (rank, kind, chunk, peer, context; the cost model's
    :attr:`~primuspipe.ir.cost_model.CostModel.late_w` is such a context): this keeps simulate
    fast enough for search loops over large tables.
    """
    placement, wiring = table.placement, table.wiring
    programs = []
    for rank, (row, moves, takes, slots) in enumerate(zip(table.ranks, wiring.moves, wiring.takes, wires.slots)):
        records: dict[tuple, Compute | Post] = {}  # (kind, chunk, peer, pair chunk) -> its record
        warmed: set[tuple] = set()  # (kind, chunk) whose first node of the step has run
        reloads = host_copies.reloaded(table, rank)
        ops: list[Op] = []
        needs: list[tuple[int, ...]] = []
        previous = None  # the rank's last compute node
        windows = window_openings(row) if cost.prices_windows else [False] * len(row)
        for node, moved, takes_keys, slot, window in zip(row, moves, takes, slots, windows):
            kind = node.kind
            if kind.on_host_stream:
                key = host_copies.reload_key(rank, node.chunk, node.microbatch, table) if kind is NodeKind.RELOAD else None
                ops.append(Copy(host_copies.copy_stream(kind), cost.copy_time(placement.stage(rank, node.chunk)), key))
                needs.append(())
                continue
            posted = moved >= 0
            warm = cost.w_warm is not None and warm_weight_grad(previous, node)  # a context only where W has two costs
            late = cost.late_time(placement, rank, node)  # the one cost that depends on the microbatch
            shape_key = (kind, node.chunk, node.peer, node.pair and node.pair[1], warm, window, late)
            if (record := records.get(shape_key)) is None:
                record = records[shape_key] = _record(placement, rank, node, cost, posted, previous, window)
            if kind.is_compute:
                previous = node
            if not posted:
                if cost.cold_start is not None and (first := [p for p in node.parts() if (p.kind, p.chunk) not in warmed]):
                    warmed.update((p.kind, p.chunk) for p in first)
                    record = Compute(record.host, record.duration + cost.cold_start_time(
                        [(p.kind, placement.stage(rank, p.chunk)) for p in first]))
                if reloads:
                    takes_keys = (*takes_keys, *host_copies.waits_for_reload(table, rank, node, reloads))
            ops.append(record)
            needs.append(takes_keys)
        programs.append(Program(ops, needs, slots))
    return programs


def _record(placement: Placement, rank: int, node: ScheduleNode, cost: CostModel, posted: bool,
            previous: ScheduleNode | None, window: bool) -> Compute | Post:
    """The record of a node of this (rank, kind, chunk, peer, context): a compute node's host
    overhead and duration (after ``previous``, the rank's last compute node; ``window``: in a probe
    window), or a send's or receive's post time and transfer time."""
    kind = node.kind
    if kind.is_compute:
        host, time = cost.host.before(kind), cost.node_time(placement, rank, node, previous, window)
    else:
        src, dst = (rank, node.peer) if kind.is_send else (node.peer, rank)
        host, time = cost.host.post(kind), cost.p2p.transfer_time(src, dst)
    return Post(host, time) if posted else Compute(host, time)
