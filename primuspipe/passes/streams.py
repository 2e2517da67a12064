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
receive complete together once both run (a rendezvous: the blocking NCCL semantics, and gloo's send
that completes once its receive is posted). Under ``gloo`` each operation is a stream of its own. The
table hangs exactly when some rank never reaches its row's end; the report follows the chain of
operations each waits on until it closes, naming streams, ranks and nodes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from primuspipe.errors import ConfigError
from primuspipe.ir.dataflow import released_transfer
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


class _Replay:
    """The state of one replay. Ops (communication nodes) are ints, numbered in row order rank by rank,
    and an *item* is what a stream runs at once (one op, or a batch's ops); the state is lists and
    bytearrays indexed by them, since a pp 64, m 512 table has a quarter of a million ops."""

    def __init__(self, table: ScheduleTable, semantics: Semantics):
        self.table, self.semantics = table, semantics
        self.where: list[tuple[int, int]] = []             # op -> (rank, index)
        self.partner: list[int] = []                       # op -> the peer rank's op it meets
        self.item_of: list[int] = []
        self.items: list[list[int]] = []                   # item -> its ops
        self.item_stream: list[int] = []
        self.stream_name: list[tuple[int, StreamKey]] = []  # stream -> (rank, key)
        self.queues: list[list[int]] = []                  # stream -> its items in posting order
        self.programs: list[list[int]] = []
        """Per rank, its row as the replay walks it: ``item`` (>= 0) posts an item, ``~i`` waits at
        compute node ``i`` (``~len(row)``: the row's end) for the ops ``needs[rank][i]``."""
        self.needs: list[dict[int, list[int]]] = []
        unpaired: dict[int, int] = {}                      # transfer key -> the op that moves it
        for rank, row in enumerate(table.ranks):
            first_op, streams, program = len(self.where), {}, []
            run: list[int] = []                            # the items of this run of communication nodes
            batch: dict[int, int] = {}                     # stream -> its item open in this run
            for i, key in enumerate(table.wiring.moves[rank]):
                if key < 0:  # posting never waits: a run of communication nodes is posted as one
                    program += run
                    program.append(~i)
                    run.clear()
                    batch.clear()
                    continue
                op = len(self.where)
                self.where.append((rank, i))
                self.partner.append(-1)
                if (other := unpaired.pop(key, None)) is not None:
                    self.partner[op], self.partner[other] = other, op
                else:
                    unpaired[key] = op
                name = semantics.stream(rank, row[i]) if semantics.stream else ("op", rank, i)
                if (stream := streams.get(name)) is None:
                    stream = streams[name] = len(self.queues)
                    self.queues.append([])
                    self.stream_name.append((rank, name))
                if (item := batch.get(stream)) is None:
                    item = len(self.items)
                    self.items.append([])
                    self.item_stream.append(stream)
                    self.queues[stream].append(item)
                    run.append(item)
                    if semantics.batches:
                        batch[stream] = item
                self.items[item].append(op)
                self.item_of.append(item)
            self.programs.append(program + run + [~len(row)])
            self.needs.append(self._needs(rank, range(first_op, len(self.where))))
        assert not unpaired, "pairing is checked before the replay"
        self.head = [0] * len(self.queues)                 # stream -> the index of its first incomplete item
        self.left = [len(ops) for ops in self.items]       # item -> its ops not yet complete
        self.posted = bytearray(len(self.items))
        self.running = bytearray(len(self.where))
        self.done = bytearray(len(self.where))
        self.at = [0] * table.pp                           # rank -> its position in its program
        self.waiting: dict[int, int] = {}                  # op -> the rank stopped on it
        self.stopped_on: dict[int, int] = {}               # rank -> the op it waits on
        self.ready: deque[int] = deque(range(table.pp))    # ranks that may move on
        self.heads: list[int] = []                         # streams whose head item may start

    def _needs(self, rank: int, ops_here: range) -> dict[int, list[int]]:
        """Per compute index of ``rank``, the ops it waits for (received inputs, sends it proves
        delivered), last first; ``len(row)``: the row's end waits for every op of the rank."""
        table, wiring = self.table, self.table.wiring
        routes, per_route = wiring.routes, wiring.microbatches
        row, stages = table.ranks[rank], table.placement.stages[rank]
        op_of = {wiring.moves[rank][self.where[op][1]]: op for op in ops_here}
        proves: dict[tuple, int] = {}                      # (kind, route taken) -> first key of the send it proves
        needs: dict[int, list[int]] = {}
        for i, keys in enumerate(wiring.takes[rank]):
            if not keys:
                continue
            ops = []
            for kind, mb, chunk in row[i].parts():
                for key in keys:
                    route, key_mb = divmod(key, per_route)
                    if key_mb != mb or routes[route].dst_stage != stages[chunk]:
                        continue
                    ops.append(op_of[key])
                    if (sent := proves.get((kind, route))) is None:
                        proved = released_transfer(table.placement, kind, stages[chunk], routes[route].src_stage, 0)
                        first = None if proved is None else wiring.key(proved)
                        sent = proves[kind, route] = -1 if first is None else first
                    if sent >= 0 and (op := op_of.get(sent + mb)) is not None:
                        ops.append(op)
            if ops:
                needs[i] = ops[::-1]
        needs[len(row)] = list(reversed(ops_here))
        return needs

    def run(self) -> Hang | None:
        while self.heads or self.ready:
            if self.heads:
                self._start(self.heads.pop())
            else:
                self._advance(self.ready.popleft())
        stopped = {r: ~self.programs[r][self.at[r]] for r in sorted(self.stopped_on)}
        return self._explain(stopped) if stopped else None

    def _advance(self, rank: int) -> None:
        """Move ``rank`` along its row until it waits on an op that has not completed."""
        self.stopped_on.pop(rank, None)
        program, needs, done = self.programs[rank], self.needs[rank], self.done
        at = self.at[rank]
        while at < len(program):
            if (entry := program[at]) >= 0:
                self.posted[entry] = 1
                self._start(self.item_stream[entry])
            elif ops := needs.get(~entry):
                while ops and done[ops[-1]]:
                    ops.pop()
                if ops:
                    self.waiting[ops[-1]] = rank
                    self.stopped_on[rank] = ops[-1]
                    break
            at += 1
        self.at[rank] = at

    def _start(self, stream: int) -> None:
        """Run the stream's head item if its rank has posted it; complete each op that meets its
        running peer."""
        queue, running, partner = self.queues[stream], self.running, self.partner
        if self.head[stream] == len(queue) or not self.posted[item := queue[self.head[stream]]]:
            return
        ops = self.items[item]
        if running[ops[0]]:
            return
        for op in ops:
            running[op] = 1
        for op in ops:
            if running[partner[op]] and not self.done[op]:
                self._complete(op)
                self._complete(partner[op])

    def _complete(self, op: int) -> None:
        self.done[op] = 1
        if (rank := self.waiting.pop(op, None)) is not None:
            self.ready.append(rank)
        item = self.item_of[op]
        self.left[item] -= 1
        if self.left[item] == 0:
            stream = self.item_stream[item]
            self.head[stream] += 1
            self.heads.append(stream)

    # -- the report ------------------------------------------------------------------------------------

    def _name(self, op: int) -> str:
        rank, i = self.where[op]
        return f"rank {rank} node {i} ({self.table.ranks[rank][i]})"

    def _blocker(self, op: int) -> tuple[int, str]:
        """The op that must complete before ``op`` can, and why."""
        if not self.running[op]:
            stream = self.item_stream[self.item_of[op]]
            rank, key = self.stream_name[stream]
            head = next(o for o in self.items[self.queues[stream][self.head[stream]]] if not self.done[o])
            return head, f"queued on rank {rank}'s {self.semantics.describe(key)} behind"
        peer = self.partner[op]
        if not self.posted[self.item_of[peer]]:
            peer_rank = self.where[peer][0]
            at = ~self.programs[peer_rank][self.at[peer_rank]]
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
        nodes = {self.where[o] for o, _ in cycle} | {(r, i) for r, i in stopped.items() if i < len(self.table.ranks[r])}
        return Hang(stopped, {r: self.where[self.stopped_on[r]][1] for r in stopped}, lines, tuple(sorted(nodes)))


def replay(table: ScheduleTable, semantics: Semantics | str = DEFAULT_SEMANTICS) -> Hang | None:
    """Replay a full table (communication added, pairing checked) under ``semantics``; None when
    every rank reaches its row's end, else why not."""
    if isinstance(semantics, str):
        semantics = semantics_named(semantics)
    if not table.has_communication:
        return None
    return _Replay(table, semantics).run()
