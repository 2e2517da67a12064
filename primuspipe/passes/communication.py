"""The pass that turns a compute-only table into a full one with SEND/RECV nodes.

Placement policy, and why:

* a send goes right after the compute node that produced the tensor, so the peer is never kept waiting
  by anything but the producer itself;
* a receive is posted one compute step before its consumer, so the transfer overlaps the preceding
  compute (the runner posts receives without blocking; only the consumer waits);
* per direction (source rank -> destination rank) the receives are posted in exactly the order the
  source posts its sends. Transports match point-to-point messages between a pair in posting order
  (NCCL/RCCL, gloo), so this is what keeps an activation from ever being matched with a gradient when
  both neighbours are the same rank (docs/design.md §3). Where consumption order differs from production
  order, the receive is moved earlier, never the compute;
* a hand-off between chunks on the same rank stays local: no communication node.
"""

from __future__ import annotations

from collections import defaultdict

from primuspipe.ir.dataflow import Transfer, comm_node
from primuspipe.errors import TableFormatError
from primuspipe.ir.node import ScheduleNode, shared_node
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import check_structure


def add_communication(table: ScheduleTable) -> ScheduleTable:
    if table.has_communication:
        raise TableFormatError(
            "add_communication takes a compute-only table, but this one already has SEND/RECV nodes; "
            "pass table.compute_only() to rebuild its communication"
        )
    check_structure(table)  # the wiring below indexes stages and microbatches by the nodes' numbers
    placement, wiring, m = table.placement, table.wiring, table.microbatches
    ends: list[tuple] = []  # per route: ((kind, chunk, peer) of its send, of its receive), source rank
    for route in wiring.routes:
        first = Transfer(*route, 0)
        send, recv = comm_node(placement, first, send=True), comm_node(placement, first, send=False)
        ends.append(((send.kind, send.chunk, send.peer), (recv.kind, recv.chunk, recv.peer),
                     placement.rank_of(route.src_stage)))

    send_order: dict[int, int] = {}  # transfer key -> its position among its source's sends
    for gives in wiring.gives:
        for keys in gives:
            for key in keys:
                send_order[key] = len(send_order)
    ranks, moves, takes, gives = [], [], [], []  # the full table's rows and wiring
    for rank, row in enumerate(table.ranks):
        wanted = [(slot, ends[key // m][2], key) for slot, keys in zip(_wanted_slots(row), wiring.takes[rank])
                  for key in keys]
        recvs_before: dict[int, list[int]] = defaultdict(list)
        for slot, _, _, key in sorted(_slots_in_send_order(wanted, send_order)):
            recvs_before[slot].append(key)
        new_row: list[ScheduleNode] = []
        row_moves, row_takes, row_gives = [], [], []  # a communication node moves one key, takes and gives none

        def comm(key: int, end: int) -> None:
            kind, chunk, peer = ends[key // m][end]
            new_row.append(shared_node(kind, key % m, chunk, peer))
            row_moves.append(key)
            row_takes.append(())
            row_gives.append(())

        for k, (node, taken, given) in enumerate(zip(row, wiring.takes[rank], wiring.gives[rank])):
            for key in recvs_before.get(k, ()):
                comm(key, 1)
            new_row.append(node)  # a compute node keeps its own
            row_moves.append(-1)
            row_takes.append(taken)
            row_gives.append(given)
            for key in given:
                comm(key, 0)
        ranks.append(new_row)
        moves.append(row_moves)
        takes.append(row_takes)
        gives.append(row_gives)
    return table.with_ranks(ranks, wiring.with_rows(moves, takes, gives))


def _wanted_slots(row: list[ScheduleNode]) -> list[int]:
    """Per node, where a receive it consumes would like to be posted, ignoring other receives: before the
    previous compute-stream node (host copies, OFFLOAD and RELOAD, take no compute time, so a receive
    keeps its place around them). :func:`_slots_in_send_order` then settles the slots."""
    slots, before = [], 0
    for k, node in enumerate(row):
        slots.append(before)
        if not node.kind.on_host_stream:
            before = k
    return slots


def _slots_in_send_order(wanted: list[tuple[int, int, int]], send_order: dict[int, int]) -> list[tuple[int, int, int, int]]:
    """The slot each receive of one rank is posted at (the compute index it goes before), given where each
    wants to be (:func:`_wanted_slots`) and that per source receives follow the source's send order, as
    ``(slot, source rank, send order, transfer key)``; ``wanted`` holds ``(wanted slot, source rank,
    transfer key)``.

    Each receive wants the slot one compute step before its consumer (``wanted`` gives it); walking
    each source's receives backwards in the source's send order, a receive is pulled earlier until it
    precedes the next one.
    """
    by_src: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for slot, src, key in wanted:
        # a transfer nobody sends sorts last; the validator reports it as incomplete
        by_src[src].append((send_order.get(key, len(send_order)), slot, key))
    slots = []
    for src, recvs in by_src.items():
        latest = None
        for order, slot, key in sorted(recvs, reverse=True):
            if latest is not None:
                slot = min(slot, latest)
            latest = slot
            slots.append((slot, src, order, key))
    return slots
