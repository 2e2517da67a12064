"""Transport semantics as data, and the replay that proves a table cannot hang under them.

A table is safe only under a model of *how* its sends and receives progress. Transports differ:

=================  =========================================================================================
``gloo``           every operation progresses on its own once posted; per direction the k-th send meets the
                   k-th receive (gloo matches by peer and tag, in posting order).
``nccl-pair``      NCCL/RCCL through torch's ``ProcessGroupNCCL``, lazy communicator init (the default):
                   every *unbatched* send/recv between two ranks runs on the pair's own communicator and
                   one stream keyed by the rank pair -- both directions share it, in posting order -- and
                   ``ncclSend``/``ncclRecv`` block that stream until the peer's matching operation runs.
``nccl-group``     the same under eager init (the group created with ``device_id``): unbatched
                   point-to-point reuses the group's communicator, so **all peers share one stream**.
``nccl-batched``   the runs of consecutive communication nodes of a row posted as one
                   ``batch_isend_irecv`` (one ``ncclGroupStart``/``ncclGroupEnd``): the ops of a batch
                   progress together, batches run one after another on the group's stream.
``primuspipe``     primuspipe's own transport (:mod:`primuspipe.runtime.transport`): one two-rank process
                   group per direction and neighbour pair, so each stream carries one direction, in order,
                   blocking -- under lazy and eager init alike. The default: what the runner runs.
=================  =========================================================================================

Sources: NCCL's point-to-point documentation ("ncclSend/ncclRecv ... is blocking for the GPU. If
multiple ncclSend and ncclRecv operations need to progress concurrently to complete, they must be
fused within a ncclGroupStart/ncclGroupEnd section") and torch's ``ProcessGroupNCCL`` (the stream and
communicator keys: ``lowRank:highRank`` for unbatched point-to-point, the device for collectives and
coalesced batches; the group's own communicator for every operation when it was bound to a device).

**The replay** (:func:`replay`) runs every rank's row as the device runs it. A rank's position moves
over its row: posting a send or receive never stops it; a compute node waits for the receives it
consumes and for the earlier send it proves delivered (the runner completes both right there, see
:mod:`primuspipe.runtime.plan`); the row's end waits for everything. An operation *runs* once its rank
has posted it and, on a serial stream, every earlier item of that stream has completed; a send and its
receive meet once both run (a rendezvous: the blocking NCCL semantics, and gloo's send that completes
once its receive is posted), and an operation completes -- for its rank's waits and its stream -- when
every operation of its item has met: a batch is one NCCL group, whose one request (torch's
``batch_isend_irecv`` returns the coalesced group's single work on NCCL) and stream end with its last
operation. Under ``gloo`` each operation is a stream of its own. The
table hangs exactly when some rank never reaches its row's end; the report follows the chain of
operations each waits on until it closes, naming streams, ranks and nodes.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from primuspipe.errors import ConfigError
from primuspipe.ir.dataflow import Pairing, released_transfer
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable

StreamKey = tuple
"""Names one in-order stream of a rank (the peer rank of the same key holds the matching stream)."""


@dataclass(frozen=True)
class Semantics:
    """How a transport progresses point-to-point operations (see the module docstring)."""

    name: str
    summary: str
    """One line for ``--help`` and reports."""
    stream: Callable[[int, ScheduleNode], StreamKey] | None
    """The stream an operation of ``rank`` runs on; None: every operation progresses on its own."""
    batches: bool = False
    """Consecutive communication nodes of a row form one batch (one NCCL group) on their stream."""

    def describe(self, key: StreamKey) -> str:
        kind, *ranks = key
        if kind == "pair":
            return f"pair stream {ranks[0]}<->{ranks[1]}"
        if kind == "direction":
            return f"stream {ranks[0]}->{ranks[1]}"
        if kind == "group":
            return "group stream"
        return "own progress"


def _pair(rank: int, node: ScheduleNode) -> StreamKey:
    return ("pair", min(rank, node.peer), max(rank, node.peer))


def _direction(rank: int, node: ScheduleNode) -> StreamKey:
    return ("direction", rank, node.peer) if node.kind.is_send else ("direction", node.peer, rank)


def _group(rank: int, node: ScheduleNode) -> StreamKey:  # noqa: ARG001 - every operation on one stream
    return ("group",)


SEMANTICS: dict[str, Semantics] = {s.name: s for s in (
    Semantics("gloo", "every operation progresses on its own; per direction, sends meet receives in order", None),
    Semantics("nccl-pair", "NCCL, lazy init: unbatched ops of a rank pair on one in-order blocking stream "
              "(both directions)", _pair),
    Semantics("nccl-group", "NCCL, eager init (device_id): unbatched ops to every peer on the group's one "
              "in-order blocking stream", _group),
    Semantics("nccl-batched", "NCCL, each run of consecutive send/recv nodes one batch_isend_irecv on the "
              "group's in-order stream", _group, batches=True),
    Semantics("primuspipe", "primuspipe's GPU transport: one two-rank group per direction, so each blocking "
              "stream carries one direction in order (lazy or eager init)", _direction),
)}
DEFAULT_SEMANTICS = "primuspipe"


def semantics_named(name: str) -> Semantics:
    try:
        return SEMANTICS[name]
    except (KeyError, TypeError):  # TypeError: a name that is no string (a list)
        raise ConfigError(f"unknown transport semantics {name!r}; choose one of {', '.join(SEMANTICS)}") from None


@dataclass(frozen=True)
class Hang:
    """Why a table cannot complete: the ranks that never reach their row's end (rank -> the index of
    the node each stops at, ``len(row)`` for the row's end), the index of the operation each of them
    waits on there, and the closed chain of waits, one line per link, with the ``(rank, index)`` of
    every node it names."""

    stopped: dict[int, int]
    waits_on: dict[int, int]
    chain: tuple[str, ...]
    nodes: tuple[tuple[int, int], ...]


class Queues:
    """What each rank's streams run, in order, under one semantics: compiled once per (table, semantics)
    (:func:`queues`) for the replay here and the simulator's clock (:mod:`primuspipe.simulator.transport`).

    Its ops are the table's :class:`~primuspipe.ir.dataflow.Pairing` ops (its SEND/RECV nodes, numbered in
    row order rank by rank). An *item* is what a stream runs at once: an op, or under
    :attr:`Semantics.batches` a batch -- a run of consecutive communication nodes of a row on one stream.
    Streams are a rank's own: the peer rank's stream of the same key holds the matching items.

    * ``items``: batched, item -> its ops; None when every op is an item of its own (its number its op's);
    * ``item_of``: batched, op -> its item (empty otherwise);
    * ``sizes``: item -> how many ops it has (read-only: the replay and the clock count down copies);
    * ``after`` / ``next``: item -> the item before / after it on its stream, -1 for none (an op that
      progresses on its own, a stream key None, has neither).

    A stream key is asked of the semantics once per side of the pairing (rank, kind, peer): every
    semantics keys a stream by those, and a search loop compiles tables of 10^5 nodes."""

    __slots__ = ("items", "item_of", "sizes", "after", "next")

    def __init__(self, pairing: Pairing, semantics: Semantics) -> None:
        batched = semantics.batches
        self.items: list[list[int]] | None = [] if batched else None
        self.item_of: list[int] = []
        self.after: list[int] = []
        self.next: list[int] = []
        side, where = pairing.side, pairing.where
        streams = [None if semantics.stream is None else semantics.stream(*end) for end in pairing.sides]
        for ops in pairing.ops:
            last: dict[StreamKey, int] = {}      # stream -> its last item so far
            open_batch: dict[StreamKey, int] = {}  # batched: stream -> the item its open batch fills
            previous = -2
            for op in ops:
                stream = streams[side[op]]
                if batched:
                    i = where[op][1]
                    if i != previous + 1:  # a compute node between: the open batches are posted
                        open_batch.clear()
                    previous = i
                    if (item := open_batch.get(stream, -1)) >= 0:
                        self.items[item].append(op)
                        self.item_of.append(item)
                        continue
                    item = open_batch[stream] = len(self.items)
                    self.items.append([op])
                    self.item_of.append(item)
                else:
                    item = op
                before = -1 if stream is None else last.get(stream, -1)
                self.after.append(before)
                self.next.append(-1)
                if before >= 0:
                    self.next[before] = item
                if stream is not None:
                    last[stream] = item
        self.sizes: list[int] = [1] * len(self.after) if self.items is None else [len(i) for i in self.items]


_queues: weakref.WeakKeyDictionary[Pairing, dict[Semantics, Queues]] = weakref.WeakKeyDictionary()
"""Per table's :class:`~primuspipe.ir.dataflow.Pairing` (by identity: hashing a table walks its nodes), its
:class:`Queues` per semantics, dropped with it."""


def queues(table: ScheduleTable, semantics: Semantics) -> Queues:
    """The table's :class:`Queues` under ``semantics``, compiled on first use: validating a table and
    simulating it under one transport compile its streams once."""
    known = _queues.setdefault(table.pairing, {})
    if (compiled := known.get(semantics)) is None:
        compiled = known[semantics] = Queues(table.pairing, semantics)
    return compiled


class _Replay:
    """The state of one replay over the table's :class:`Queues`. Ops and items are ints (see there). The
    state is lists and bytearrays of ints, with no object per op: a pp 64, m 512 table has a quarter of
    a million ops, and objects made by the hundred thousand wake the garbage collector, which then walks
    the whole heap of a big table."""

    def __init__(self, table: ScheduleTable, semantics: Semantics):
        self.table, self.semantics = table, semantics
        pairing = table.pairing                            # the ops: the table's SEND/RECV nodes, with partners
        assert not pairing.swapped and not pairing.unmatched, "pairing is checked before the replay"
        self.rank_ops: list[range] = pairing.ops           # rank -> its ops
        self.index: list[int] = [i for _, i in pairing.where]  # op -> its node's index in its row
        self.partner: list[int] = pairing.partner          # op -> the peer rank's op it meets
        compiled = queues(table, semantics)
        self.items, self.item_of, self.next = compiled.items, compiled.item_of, compiled.next
        self.programs: list[list[int]] = []
        """Per rank, its row as the replay walks it: ``item`` (>= 0) posts an item, ``~op`` waits for
        ``op`` to complete (a compute node's inputs and the sends they prove delivered; at the row's
        end every op of the rank)."""
        self.nodes: list[list[int]] = []                   # rank -> per program entry, its row index
        for rank in range(table.pp):
            self._program(rank)
        self.free = bytearray(map((-1).__eq__, compiled.after))  # item -> every earlier item of its stream completed
        self.left = list(compiled.sizes)                   # item -> its ops not yet complete
        self.posted = bytearray(len(compiled.after))
        self.running = bytearray(len(self.index))
        self.met = bytearray(len(self.index))             # op -> it met its partner
        self.done = bytearray(len(self.index))            # op -> its item completed (every op of it met)
        self.at = [0] * table.pp                           # rank -> its position in its program
        self.waiting: dict[int, int] = {}                  # op -> the rank stopped on it
        self.stopped_on: dict[int, int] = {}               # rank -> the op it waits on
        self.ready: deque[int] = deque(range(table.pp))    # ranks that may move on
        self.startable: list[int] = []                     # posted items whose stream just became free

    def _program(self, rank: int) -> None:
        """``rank``'s program (see :attr:`programs`)."""
        table, wiring = self.table, self.table.wiring
        routes, per_route = wiring.routes, wiring.microbatches
        row, stages = table.ranks[rank], table.placement.stages[rank]
        ops, key_of = self.rank_ops[rank], table.pairing.key
        op_of = {key_of[op]: op for op in ops}            # transfer key -> the rank's op moving it
        program: list[int] = []
        nodes: list[int] = []
        proves: dict[tuple, int] = {}                      # (kind, route taken) -> first key of the send it proves
        op = ops.start
        for i, (key, takes) in enumerate(zip(wiring.moves[rank], wiring.takes[rank])):
            if key >= 0:  # an item is posted with its last op
                item = op if self.items is None else self.item_of[op]
                if self.items is None or self.items[item][-1] == op:
                    program.append(item)
                    nodes.append(i)
                op += 1
                continue
            for kind, mb, chunk in row[i].parts() if takes else ():
                for taken in takes:
                    route, taken_mb = divmod(taken, per_route)
                    if taken_mb != mb or routes[route].dst_stage != stages[chunk]:
                        continue
                    if (sent := proves.get((kind, route))) is None:
                        proved = released_transfer(table.placement, kind, stages[chunk], routes[route].src_stage, 0)
                        first = None if proved is None else wiring.key(proved)
                        sent = proves[kind, route] = -1 if first is None else first
                    for waited in (op_of[taken], op_of.get(sent + mb, -1) if sent >= 0 else -1):
                        if waited >= 0:
                            program.append(~waited)
                            nodes.append(i)
        program += [~op for op in ops]
        nodes += [len(row)] * len(ops)
        self.programs.append(program)
        self.nodes.append(nodes)

    def run(self) -> Hang | None:
        while self.startable or self.ready:
            if self.startable:
                self._start(self.startable.pop())
            else:
                self._advance(self.ready.popleft())
        stopped = {r: self.nodes[r][self.at[r]] for r in sorted(self.stopped_on)}
        return self._explain(stopped) if stopped else None

    def _advance(self, rank: int) -> None:
        """Move ``rank`` along its row until it waits on an op that has not completed."""
        self.stopped_on.pop(rank, None)
        program, done = self.programs[rank], self.done
        at = self.at[rank]
        while at < len(program):
            if (entry := program[at]) >= 0:
                self.posted[entry] = 1
                if self.free[entry]:
                    self._start(entry)
            elif not done[~entry]:
                self.waiting[~entry] = rank
                self.stopped_on[rank] = ~entry
                break
            at += 1
        self.at[rank] = at

    def _start(self, item: int) -> None:
        """Run a posted item whose stream is free; complete each op that meets its running peer."""
        ops = (item,) if self.items is None else self.items[item]
        running, partner = self.running, self.partner
        for op in ops:
            running[op] = 1
        for op in ops:
            if running[partner[op]] and not self.met[op]:
                self._meet(op)
                self._meet(partner[op])

    def _meet(self, op: int) -> None:
        """``op`` met its partner: its item completes with the last of its ops to meet."""
        self.met[op] = 1
        item = op if self.items is None else self.item_of[op]
        self.left[item] -= 1
        if self.left[item]:
            return
        for each in (op,) if self.items is None else self.items[item]:
            self.done[each] = 1
            if (rank := self.waiting.pop(each, None)) is not None:
                self.ready.append(rank)
        if (nxt := self.next[item]) >= 0:
            self.free[nxt] = 1
            if self.posted[nxt]:
                self.startable.append(nxt)

    # -- the report ------------------------------------------------------------------------------------

    def _rank(self, op: int) -> int:
        """The rank of ``op`` (a search: only a report asks)."""
        return next(rank for rank, ops in enumerate(self.rank_ops) if op in ops)

    def _name(self, op: int) -> str:
        rank, i = self._rank(op), self.index[op]
        return f"rank {rank} node {i} ({self.table.ranks[rank][i]})"

    def _stream(self, op: int) -> StreamKey:
        """The stream ``op`` runs on, asked again: the replay keeps no key per op."""
        rank, i = self._rank(op), self.index[op]
        node = self.table.ranks[rank][i]
        return ("op", rank, i) if self.semantics.stream is None else self.semantics.stream(rank, node)

    def _blocker(self, op: int) -> tuple[int, str]:
        """The op that must complete before ``op`` can, and why."""
        if not self.running[op]:  # queued: the first op of its stream not complete runs, or waits
            rank, key = self._rank(op), self._stream(op)
            head = next(o for o in self.rank_ops[rank] if not self.done[o] and self._stream(o) == key)
            return head, f"queued on rank {rank}'s {self.semantics.describe(key)} behind"
        if self.met[op]:  # batched: it met its partner, its batch waits for another of its ops
            rest = next(o for o in self.items[self.item_of[op]] if not self.met[o])
            return rest, "completes with its batch, which waits for"
        peer = self.partner[op]
        if not self.posted[peer if self.items is None else self.item_of[peer]]:
            peer_rank = self._rank(peer)
            at = self.nodes[peer_rank][self.at[peer_rank]]
            where = "its row's end" if at == len(self.table.ranks[peer_rank]) else \
                f"node {at} ({self.table.ranks[peer_rank][at]})"
            return self.stopped_on[peer_rank], (f"needs {self._name(peer)}, which rank {peer_rank} never posts: "
                                                f"it stops at {where}, waiting for")
        return peer, "needs its peer"

    def _explain(self, stopped: dict[int, int]) -> Hang:
        op = self.stopped_on[min(stopped)]
        seen: dict[int, int] = {}
        links: list[tuple[int, str]] = []
        while op not in seen:
            seen[op] = len(links)
            nxt, why = self._blocker(op)
            links.append((op, why))
            op = nxt
        cycle = links[seen[op]:]
        lines = tuple(f"{self._name(o)} {why} {self._name(nxt)}"
                      for (o, why), (nxt, _) in zip(cycle, cycle[1:] + cycle[:1]))
        nodes = {(self._rank(o), self.index[o]) for o, _ in cycle}
        nodes |= {(r, i) for r, i in stopped.items() if i < len(self.table.ranks[r])}
        return Hang(stopped, {r: self.index[self.stopped_on[r]] for r in stopped}, lines, tuple(sorted(nodes)))


def replay(table: ScheduleTable, semantics: Semantics | str = DEFAULT_SEMANTICS) -> Hang | None:
    """Replay a full table (communication added, pairing checked) under ``semantics``; None when
    every rank reaches its row's end, else why not."""
    if isinstance(semantics, str):
        semantics = semantics_named(semantics)
    if not table.has_communication:
        return None
    return _Replay(table, semantics).run()
