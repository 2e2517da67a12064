"""When each send and receive runs and completes under the transport's streams.

The validator's replay (:mod:`primuspipe.passes.streams`) decides *whether* a table completes under
a transport's semantics; this module times the same rules. :class:`Wires` compiles the table's
communication once: every send/receive gets a *slot*, its partner (per direction the k-th send meets
the k-th receive, as every transport matches messages), and the *item* it belongs to on its rank's
stream -- the stream key is the semantics' own :attr:`~primuspipe.passes.streams.Semantics.stream`,
and with :attr:`~primuspipe.passes.streams.Semantics.batches` a run of consecutive communication
nodes on one stream is one item, as the replay batches them. :class:`StreamClock` then times them:

* an item *runs* once its rank has posted it (its last operation) and the item before it on the same
  stream has completed -- a stream is serial and in order;
* a send and its receive complete together (a rendezvous) ``transfer time`` after the later of the
  two started running; an item completes when all its operations have.

So a transfer that waits on its peer delays every later item of its stream. Under ``gloo`` every
operation is an item and a stream of its own, which is the simulator's model before transports had
streams. Every time is a value of its dependencies only, so the engine may post in any order.
"""

from __future__ import annotations

from collections import deque

from primuspipe.errors import SimulationError
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.streams import Semantics


class Wires:
    """The table's communication, compiled for :class:`StreamClock` (see the module docstring)."""

    def __init__(self, table: ScheduleTable, semantics: Semantics):
        wiring = table.wiring
        self.where: list[tuple[int, int]] = []  # slot -> (rank, index)
        self.key: list[int] = []                # slot -> transfer key
        self.item_of: list[int] = []            # slot -> item
        self.items: list[list[int]] = []        # item -> its slots
        self.item_queue: list[int] = []         # item -> the stream queue it runs on
        self.queues: list[list[int]] = []       # queue (a rank's stream) -> its items in order
        self.slots: list[list[int]] = []        # rank -> per node, its slot (-1: not communication)
        queue_of: dict[tuple, int] = {}
        lanes: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for rank, (row, moves) in enumerate(zip(table.ranks, wiring.moves)):
            slots = [-1] * len(row)
            open_batch: dict[int, int] = {}  # queue -> the item a batch is filling
            for i, (node, moved) in enumerate(zip(row, moves)):
                if moved < 0:
                    open_batch.clear()
                    continue
                slot = slots[i] = len(self.where)
                self.where.append((rank, i))
                self.key.append(moved)
                src, dst = (rank, node.peer) if node.kind.is_send else (node.peer, rank)
                lanes.setdefault((src, dst), ([], []))[0 if node.kind.is_send else 1].append(slot)
                stream = ("op", slot) if semantics.stream is None else semantics.stream(rank, node)
                queue = queue_of.setdefault((rank, stream), len(queue_of))
                if queue == len(self.queues):
                    self.queues.append([])
                item = open_batch.get(queue, -1)
                if item < 0:
                    item = len(self.items)
                    self.items.append([])
                    self.item_queue.append(queue)
                    self.queues[queue].append(item)
                    if semantics.batches:
                        open_batch[queue] = item
                self.items[item].append(slot)
                self.item_of.append(item)
            self.slots.append(slots)
        self.partner = [-1] * len(self.where)
        for sends, recvs in lanes.values():
            self._pair(table, sends, recvs)

    def _pair(self, table: ScheduleTable, sends: list[int], recvs: list[int]) -> None:
        """Per direction the k-th send meets the k-th receive; refuse a pair carrying different tensors
        or an operation its peer never matches."""
        for send, recv in zip(sends, recvs):
            if self.key[send] != self.key[recv]:
                raise SimulationError(
                    f"{self._name(table, send)} is matched with {self._name(table, recv)}, which expects another "
                    "tensor; run validate(table) and rebuild communication with add_communication")
            self.partner[send], self.partner[recv] = recv, send
        if len(sends) != len(recvs):
            extra = (sends if len(sends) > len(recvs) else recvs)[min(len(sends), len(recvs))]
            raise SimulationError(f"{self._name(table, extra)} is never matched by its peer, so the step cannot "
                                  "complete. Run validate(table) for the full diagnosis.")

    def _name(self, table: ScheduleTable, slot: int) -> str:
        rank, i = self.where[slot]
        return f"rank {rank} node {i} ({table.ranks[rank][i]})"


class StreamClock:
    """Times one step's communication over :class:`Wires`: :meth:`post` each operation when its rank
    posts it; completed transfers come back with their times, and the operations' end times are written
    into ``ends`` (per rank, per node)."""

    def __init__(self, wires: Wires, ends: list[list[float]]):
        self.wires, self.ends = wires, ends
        self.unposted = [len(slots) for slots in wires.items]  # item -> operations not yet posted
        self.left = list(self.unposted)                       # item -> operations not yet completed
        self.posted_at = [0.0] * len(wires.items)
        self.item_end = [0.0] * len(wires.items)
        self.head = [0] * len(wires.queues)                   # queue -> its first item not completed
        self.free = [0.0] * len(wires.queues)                 # queue -> when its last completed item ended
        self.run_at: list[float | None] = [None] * len(wires.where)
        self.duration = [0.0] * len(wires.where)
        self._check: deque[int] = deque()

    def post(self, slot: int, time: float, duration: float) -> list[tuple[float, int, int, int]]:
        """Operation ``slot`` is posted at ``time`` and its transfer takes ``duration``. Returns the
        transfers this completes as ``(arrival, transfer key, slot, partner slot)``."""
        w = self.wires
        self.duration[slot] = duration
        item = w.item_of[slot]
        self.unposted[item] -= 1
        if self.unposted[item]:
            return []
        self.posted_at[item] = time
        done: list[tuple[float, int, int, int]] = []
        self._check.append(w.item_queue[item])
        while self._check:
            self._start_head(self._check.popleft(), done)
        return done

    def _start_head(self, queue: int, done: list) -> None:
        """Run the queue's head item if posted and not yet running; complete the pairs it meets."""
        w, items = self.wires, self.wires.queues[queue]
        if self.head[queue] == len(items):
            return
        item = items[self.head[queue]]
        first = w.items[item][0]
        if self.unposted[item] or self.run_at[first] is not None:
            return
        start = self.posted_at[item] if self.posted_at[item] > self.free[queue] else self.free[queue]
        for slot in w.items[item]:
            self.run_at[slot] = start
        for slot in w.items[item]:
            other = w.partner[slot]
            peer_start = self.run_at[other]
            if peer_start is None:
                continue
            arrival = (start if start > peer_start else peer_start) + self.duration[slot]
            done.append((arrival, w.key[slot], slot, other))
            for end in (slot, other):
                rank, i = w.where[end]
                self.ends[rank][i] = arrival
                self._complete(w.item_of[end], arrival)

    def _complete(self, item: int, arrival: float) -> None:
        if arrival > self.item_end[item]:
            self.item_end[item] = arrival
        self.left[item] -= 1
        if self.left[item] == 0:
            queue = self.wires.item_queue[item]
            self.free[queue] = self.item_end[item]
            self.head[queue] += 1
            self._check.append(queue)

    def incomplete(self) -> list[tuple[int, int]]:
        """``(rank, index)`` of every operation whose transfer never completed: it or its partner never ran."""
        run_at, partner = self.run_at, self.wires.partner
        return [self.wires.where[slot] for slot in range(len(run_at))
                if run_at[slot] is None or run_at[partner[slot]] is None]
