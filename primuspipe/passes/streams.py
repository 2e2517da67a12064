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
    """The state of one replay; ops are ``(rank, index)`` of communication nodes."""

    def __init__(self, table: ScheduleTable, semantics: Semantics):
        self.table, self.semantics = table, semantics
        wiring = table.wiring
        self.partner: dict[tuple[int, int], tuple[int, int]] = {}
        by_key: dict[int, tuple[int, int]] = {}
        self.item_of: dict[tuple[int, int], int] = {}
        self.items: list[list[tuple[int, int]]] = []   # item -> its ops
        self.item_stream: list[tuple[int, StreamKey]] = []
        self.item_posted: list[int] = []               # item -> the index its last op is posted at
        self.queues: dict[tuple[int, StreamKey], deque[int]] = {}
        for rank, row in enumerate(table.ranks):
            moves = wiring.moves[rank]
            open_batch: dict[StreamKey, int] = {}
            for i, node in enumerate(row):
                if moves[i] < 0:
                    open_batch.clear()
                    continue
                op = (rank, i)
                if (other := by_key.pop(moves[i], None)) is not None:
                    self.partner[op], self.partner[other] = other, op
                else:
                    by_key[moves[i]] = op
                key = semantics.stream(rank, node) if semantics.stream else ("op", rank, i)
                item = open_batch.get(key) if semantics.batches else None
                if item is None:
                    item = len(self.items)
                    self.items.append([])
                    self.item_stream.append((rank, key))
                    self.item_posted.append(i)
                    self.queues.setdefault((rank, key), deque()).append(item)
                    if semantics.batches:
                        open_batch[key] = item
                self.items[item].append(op)
                self.item_posted[item] = i
                self.item_of[op] = item
        assert not by_key, "pairing is checked before the replay"
        self.needs = [self._needs(rank) for rank in range(table.pp)]
        self.ptr = [0] * table.pp
        self.running: set[tuple[int, int]] = set()
        self.done: set[tuple[int, int]] = set()
        self.left = [len(ops) for ops in self.items]
        self.waiting: dict[tuple[int, int], int] = {}   # op -> the rank stopped on it
        self.stopped_on: dict[int, tuple[int, int]] = {}

    def _needs(self, rank: int) -> dict[int, list[tuple[int, int]]]:
        """Per compute index of ``rank``, the ops it waits for (received inputs, sends it proves
        delivered), last first; ``len(row)``: the row's end waits for every op."""
        table, wiring = self.table, self.table.wiring
        row, placement = table.ranks[rank], table.placement
        op_of = {wiring.moves[rank][i]: (rank, i) for i in range(len(row)) if wiring.moves[rank][i] >= 0}
        needs: dict[int, list[tuple[int, int]]] = {}
        for i, node in enumerate(row):
            if not node.kind.is_compute:
                continue
            ops = []
            for kind, mb, chunk in node.parts():
                stage = placement.stage(rank, chunk)
                for key in wiring.takes[rank][i]:
                    transfer = wiring.transfer(key)
                    if transfer.dst_stage != stage or transfer.microbatch != mb:
                        continue
                    ops.append(op_of[key])
                    sent = released_transfer(placement, kind, stage, transfer.src_stage, mb)
                    sent_key = None if sent is None else wiring.key(sent)
                    if sent_key in op_of:
                        ops.append(op_of[sent_key])
            if ops:
                needs[i] = ops[::-1]
        needs[len(row)] = sorted(op_of.values(), reverse=True)
        return needs

    def run(self) -> Hang | None:
        ready: deque[int] = deque(range(self.table.pp))
        streams: deque[tuple[int, StreamKey]] = deque()
        while ready or streams:
            if streams:
                self._start_head(streams.popleft(), ready, streams)
            else:
                self._advance(ready.popleft(), streams)
        stopped = {r: self.ptr[r] for r in range(self.table.pp) if r in self.stopped_on}
        return self._explain(stopped) if stopped else None

    def _advance(self, rank: int, streams: deque) -> None:
        """Move ``rank`` along its row until it waits on an op that has not completed."""
        self.stopped_on.pop(rank, None)
        row, needs = self.table.ranks[rank], self.needs[rank]
        i = self.ptr[rank]
        while True:
            ops = needs.get(i)
            while ops and ops[-1] in self.done:
                ops.pop()
            if ops:
                self.ptr[rank] = i
                self.waiting[ops[-1]] = rank
                self.stopped_on[rank] = ops[-1]
                return
            if i == len(row):
                self.ptr[rank] = i
                return
            if (item := self.item_of.get((rank, i))) is not None and self.item_posted[item] == i:
                self.ptr[rank] = i + 1
                streams.append(self.item_stream[item])
            i += 1

    def _start_head(self, stream: tuple[int, StreamKey], ready: deque[int], streams: deque) -> None:
        """Run the stream's head item if its rank has posted it; complete what meets its peer."""
        queue = self.queues[stream]
        if not queue:
            return
        item = queue[0]
        if self.item_posted[item] >= self.ptr[stream[0]] or self.items[item][0] in self.running:
            return
        for op in self.items[item]:
            self.running.add(op)
        for op in self.items[item]:
            if self.partner[op] in self.running and op not in self.done:
                for end in (op, self.partner[op]):
                    self._complete(end, ready, streams)

    def _complete(self, op: tuple[int, int], ready: deque[int], streams: deque) -> None:
        self.done.add(op)
        if (rank := self.waiting.pop(op, None)) is not None:
            ready.append(rank)
        item = self.item_of[op]
        self.left[item] -= 1
        if self.left[item] == 0:
            stream = self.item_stream[item]
            self.queues[stream].popleft()
            streams.append(stream)

    # -- the report ------------------------------------------------------------------------------------

    def _name(self, op: tuple[int, int]) -> str:
        rank, i = op
        return f"rank {rank} node {i} ({self.table.ranks[rank][i]})"

    def _blocker(self, op: tuple[int, int]) -> tuple[tuple[int, int], str]:
        """The op that must complete before ``op`` can, and why."""
        if op not in self.running:
            rank, key = self.item_stream[self.item_of[op]]
            head = next(o for o in self.items[self.queues[(rank, key)][0]] if o not in self.done)
            return head, f"queued on rank {rank}'s {self.semantics.describe(key)} behind"
        peer = self.partner[op]
        peer_rank = peer[0]
        if self.item_posted[self.item_of[peer]] >= self.ptr[peer_rank]:
            stuck = self.stopped_on[peer_rank]
            at = self.ptr[peer_rank]
            where = "its row's end" if at == len(self.table.ranks[peer_rank]) else \
                f"node {at} ({self.table.ranks[peer_rank][at]})"
            return stuck, (f"needs {self._name(peer)}, which rank {peer_rank} never posts: it stops at "
                           f"{where}, waiting for")
        return peer, "needs its peer"

    def _explain(self, stopped: dict[int, int]) -> Hang:
        op = self.stopped_on[min(stopped)]
        seen: dict[tuple[int, int], int] = {}
        links: list[tuple[tuple[int, int], str]] = []
        while op not in seen:
            seen[op] = len(links)
            nxt, why = self._blocker(op)
            links.append((op, why))
            op = nxt
        cycle = links[seen[op]:]
        lines = tuple(f"{self._name(o)} {why} {self._name(nxt)}"
                      for (o, why), (nxt, _) in zip(cycle, cycle[1:] + cycle[:1]))
        nodes = {o for o, _ in cycle} | {(r, i) for r, i in stopped.items() if i < len(self.table.ranks[r])}
        return Hang(stopped, {r: self.stopped_on[r][1] for r in stopped}, lines, tuple(sorted(nodes)))


def replay(table: ScheduleTable, semantics: Semantics | str = DEFAULT_SEMANTICS) -> Hang | None:
    """Replay a full table (communication added, pairing checked) under ``semantics``; None when
    every rank reaches its row's end, else why not."""
    if isinstance(semantics, str):
        semantics = semantics_named(semantics)
    if not table.has_communication:
        return None
    return _Replay(table, semantics).run()
