"""When each send and receive runs and completes under the transport's streams.

The validator's replay (:mod:`primuspipe.passes.streams`) decides *whether* a table completes under
a transport's semantics; this module times the same rules, over the same compiled communication.
:class:`Wires` gathers it: every send/receive is a *slot* (its op in the table's
:class:`~primuspipe.ir.dataflow.Pairing`, which also gives its partner: per direction the k-th send meets
the k-th receive, as every transport matches messages), and belongs to an *item* on its rank's stream
(the table's :class:`~primuspipe.passes.streams.Queues` under the semantics: the stream key is the
semantics' own :attr:`~primuspipe.passes.streams.Semantics.stream`, and with
:attr:`~primuspipe.passes.streams.Semantics.batches` a run of consecutive communication nodes on one
stream is one item). :class:`StreamClock` then times them:

* an item *runs* once its rank has posted it (its last operation) and the item before it on the same
  stream has completed -- a stream is serial and in order;
* a send and its receive complete together (a rendezvous) ``transfer time`` after the later of the
  two started running; an item completes when all its operations have. A receive's data is there for
  the compute that consumes it when its item completes: at once for an unbatched operation, at the
  batch's end for a batched one (NCCL's one request per group, :mod:`primuspipe.passes.streams`).

So a transfer that waits on its peer delays every later item of its stream. Under ``gloo`` every
operation is an item and a stream of its own, which is the simulator's model before transports had
streams. Every time is a value of its dependencies only, so the engine may post in any order.
"""

from __future__ import annotations

from primuspipe.errors import SimulationError
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.streams import Semantics, queues


class Wires:
    """The table's communication for :class:`StreamClock`: its :class:`~primuspipe.ir.dataflow.Pairing`
    (slots and partners) and its :class:`~primuspipe.passes.streams.Queues` under the semantics (items and
    their order), both compiled once per table -- the validator's replay reads the same ones."""

    def __init__(self, table: ScheduleTable, semantics: Semantics):
        pairing = table.pairing
        if pairing.swapped:
            send, recv, _ = pairing.swapped[0]
            raise SimulationError(
                f"{_name(table, pairing.where[send])} is matched with {_name(table, pairing.where[recv])}, which "
                "expects another tensor; run validate(table) and rebuild communication with add_communication")
        assert not pairing.unmatched, "a table past the completeness rule has one receive per send"
        compiled = queues(table, semantics)
        self.where = pairing.where              # slot (a table's op) -> (rank, index)
        self.key = pairing.key                  # slot -> transfer key
        self.partner = pairing.partner          # slot -> the slot it meets
        self.slots = pairing.op_at              # rank -> per node, its slot (-1: not communication)
        self.items = compiled.items             # batched: item -> its slots (None: every item is its one slot)
        self.item_of = compiled.item_of         # batched: slot -> item
        self.receives = [] if self.items is None else [pairing.sides[s][1].kind.is_recv for s in pairing.side]
        """Batched: slot -> it is a receive (its arrival is reported when its batch completes)."""
        self.sizes = compiled.sizes             # item -> its slots' count
        self.after = compiled.after             # item -> the item before it on its stream (-1: none)
        self.next = compiled.next               # item -> the item after it on its stream (-1: none)


def _name(table: ScheduleTable, where: tuple[int, int]) -> str:
    rank, i = where
    return f"rank {rank} node {i} ({table.ranks[rank][i]})"


_NONE: list = []  # what a post that completes nothing returns (never appended to)


class StreamClock:
    """Times one step's communication over :class:`Wires`: :meth:`post` each operation when its rank
    posts it; completed transfers come back with their times, and the operations' end times are written
    into ``ends`` (per rank, per node)."""

    def __init__(self, wires: Wires, ends: list[list[float]]):
        self.wires, self.ends = wires, ends
        count = len(wires.after)
        self.unposted = list(wires.sizes)              # item -> operations not yet posted
        self.left = list(wires.sizes)                  # item -> operations not yet completed
        self.blocked = [a >= 0 for a in wires.after]   # item -> the item before it has not completed
        self.posted_at = [0.0] * count
        self.free_at = [0.0] * count                   # item -> when the item before it completed
        self.item_end = [0.0] * count
        self.run_at: list[float | None] = [None] * len(wires.where)
        self.duration = [0.0] * len(wires.where)

    def post(self, slot: int, time: float, duration: float) -> list[tuple[float, int, int, int]]:
        """Operation ``slot`` is posted at ``time`` and its transfer takes ``duration``. Returns the
        transfers this completes as ``(arrival, transfer key, slot, partner slot)``."""
        self.duration[slot] = duration
        item = slot if self.wires.items is None else self.wires.item_of[slot]
        self.unposted[item] -= 1
        if self.unposted[item]:
            return _NONE
        self.posted_at[item] = time
        if self.blocked[item]:
            return _NONE
        if self.wires.items is None and self.run_at[self.wires.partner[slot]] is None:  # runs; its peer has not
            self.run_at[slot] = time if time > self.free_at[item] else self.free_at[item]
            return _NONE
        done: list[tuple[float, int, int, int]] = []
        runnable = [item]
        while runnable:
            self._run(runnable.pop(), done, runnable)
        return done

    def _run(self, item: int, done: list, runnable: list[int]) -> None:
        """Run a posted item whose stream is free; complete the pairs it meets, and queue the items
        those completions free."""
        w, run_at, duration = self.wires, self.run_at, self.duration
        start = self.posted_at[item] if self.posted_at[item] > self.free_at[item] else self.free_at[item]
        slots = (item,) if w.items is None else w.items[item]
        for slot in slots:
            run_at[slot] = start
        for slot in slots:
            other = w.partner[slot]
            peer_start = run_at[other]
            if peer_start is None:
                continue
            arrival = (start if start > peer_start else peer_start) + duration[slot]
            if w.items is None:
                done.append((arrival, w.key[slot], slot, other))
            for end in (slot, other):
                rank, i = w.where[end]
                self.ends[rank][i] = arrival
                self._complete(end if w.items is None else w.item_of[end], arrival, runnable, done)

    def _complete(self, item: int, arrival: float, runnable: list[int], done: list) -> None:
        if arrival > self.item_end[item]:
            self.item_end[item] = arrival
        self.left[item] -= 1
        if self.left[item]:
            return
        w = self.wires
        if w.items is not None:  # a batch's receives arrive for their consumers with the batch
            done += [(self.item_end[item], w.key[slot], slot, w.partner[slot]) for slot in w.items[item]
                     if w.receives[slot]]
        if (nxt := w.next[item]) >= 0:
            self.blocked[nxt] = False
            self.free_at[nxt] = self.item_end[item]
            if not self.unposted[nxt]:
                runnable.append(nxt)

    def incomplete(self) -> list[tuple[int, int]]:
        """``(rank, index)`` of every operation whose transfer never completed: it or its partner never ran."""
        run_at, partner = self.run_at, self.wires.partner
        return [self.wires.where[slot] for slot in range(len(run_at))
                if run_at[slot] is None or run_at[partner[slot]] is None]
