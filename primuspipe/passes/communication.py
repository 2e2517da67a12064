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

from primuspipe.ir.dataflow import Transfer, comm_node, inbound, outbound
from primuspipe.errors import TableFormatError
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable


def add_communication(table: ScheduleTable) -> ScheduleTable:
    if table.has_communication:
        raise TableFormatError(
            "add_communication takes a compute-only table, but this one already has SEND/RECV nodes; "
            "pass table.compute_only() to rebuild its communication"
        )
    placement = table.placement
    sends_after: list[list[list[ScheduleNode]]] = []  # [rank][compute index] -> sends
    send_order: dict[Transfer, int] = {}  # transfer -> its position among its source's sends
    recv_wanted: list[list[tuple[int, int, Transfer]]] = []  # [rank] -> (consumer index, src rank, transfer)
    for rank, row in enumerate(table.ranks):
        sends_after.append([])
        recv_wanted.append([])
        before = 0  # where a receive for this node wants posting: before the previous compute-stream node
        for k, node in enumerate(row):
            sends = []
            for kind, mb, chunk in node.parts():
                if (t := outbound(placement, rank, kind, chunk, mb)) is not None:
                    send_order[t] = len(send_order)
                    sends.append(comm_node(placement, t, send=True))
                if (t := inbound(placement, rank, kind, chunk, mb)) is not None:
                    recv_wanted[rank].append((before, placement.rank_of(t.src_stage), t))
            sends_after[rank].append(sends)
            if not node.kind.on_host_stream:  # host copies (OFFLOAD, RELOAD) take no compute time
                before = k

    ranks = []
    for rank, row in enumerate(table.ranks):
        slots = _recv_slots(recv_wanted[rank], send_order)
        recvs_before: dict[int, list[ScheduleNode]] = defaultdict(list)
        for slot, _, _, t in sorted(slots):
            recvs_before[slot].append(comm_node(placement, t, send=False))
        new_row: list[ScheduleNode] = []
        for k, node in enumerate(row):
            new_row += recvs_before[k]
            new_row.append(node)
            new_row += sends_after[rank][k]
        ranks.append(new_row)
    return table.with_ranks(ranks)


def _recv_slots(
    wanted: list[tuple[int, int, Transfer]], send_order: dict[Transfer, int]
) -> list[tuple[int, int, int, Transfer]]:
    """Slot (compute index the receive is posted before) for every receive of one rank.

    Each receive wants the slot one compute step before its consumer (``wanted`` gives it); walking
    each source's receives backwards in the source's send order, a receive is pulled earlier until it
    precedes the next one.
    """
    by_src: dict[int, list[tuple[int, int, Transfer]]] = defaultdict(list)
    for slot, src, t in wanted:
        # a transfer nobody sends sorts last; the validator reports it as incomplete
        by_src[src].append((send_order.get(t, len(send_order)), slot, t))
    slots = []
    for src, recvs in by_src.items():
        latest = None
        for order, slot, t in sorted(recvs, reverse=True):
            if latest is not None:
                slot = min(slot, latest)
            latest = slot
            slots.append((slot, src, order, t))
    return slots
