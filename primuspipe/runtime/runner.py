"""The schedule runner: executes one rank's row of a full table through a binder.

The runner knows the table and the communication semantics; the binder knows the model. A binder is
one visible map from node kind to handler (:class:`Binder`), so what runs for ``F``, ``BW``, ``B`` or
``W`` is never hidden in the runner, and a table whose kinds the binder cannot run is refused up front
with :class:`~primuspipe.errors.ConfigError`.

Semantics (exactly the ones :func:`primuspipe.passes.validation.check_deadlock` proves safe):

* a receive is posted where the table places it and never blocks; a send is posted right where the
  table places it and never blocks;
* a compute node waits only for its own inbound receives;
* per direction, the k-th send meets the k-th receive (one ordered channel per pair, see
  :mod:`primuspipe.runtime.transport`);
* everything outstanding is completed before :meth:`ScheduleRunner.run` returns.

Tensors move through explicit per-step state keyed by ``(carries, chunk, microbatch)``: a completed
receive or a same-rank hand-off fills the *inbox* of the consuming chunk; a compute part's result goes
to the *outbox* its send node reads. Nothing is looked up by searching the table, and the table is
never mutated: :class:`ScheduleRunner` holds a plan derived once from the immutable table.

>>> from primuspipe.algorithms.build import build_schedule
>>> runner = ScheduleRunner(build_schedule("1f1b", pp=2, microbatches=2), rank=1)
>>> sorted(k.value for k in runner.compute_kinds)
['BW', 'F']
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from primuspipe.ir.dataflow import outbound
from primuspipe.errors import ConfigError
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.ir.table import ScheduleTable
from primuspipe.runtime.transport import Pending
from primuspipe.passes.validation import check_deadlock, check_order, check_pairing, check_structure

Key = tuple[str, int, int]
"""``(carries, local chunk, microbatch)``: ``carries`` is ``"F"`` (activation) or ``"B"`` (gradient)."""


@dataclass(frozen=True)
class ComputeCall:
    """One compute part as a handler sees it."""

    kind: NodeKind
    """``F``, ``B``, ``W`` or ``BW``."""
    microbatch: int
    chunk: int
    stage: int
    received: Any
    """What this part consumes from a neighbouring stage: the activation for ``F``, the output gradient
    for ``B``/``BW``; ``None`` on the first stage's ``F``, the last stage's backward, and ``W``."""


Handler = Callable[[ComputeCall], Any]
"""Runs one part; returns what it hands to the neighbouring stage (``F``: activation, ``B``/``BW``:
input gradient; ignored where there is no consumer)."""


class Binder(Protocol):
    """What the runner needs from a model backend."""

    handlers: Mapping[NodeKind, Handler]
    """Node kind -> handler. ``FB`` (an overlapped pair) maps to a handler taking the F and the B call
    and returning both results; every other kind to a :data:`Handler`."""

    def recv_buffer(self, node: ScheduleNode) -> Any:
        """An empty tensor to receive ``node``'s transfer into."""

    def local_handoff(self, tensor: Any, carries: str) -> Any:
        """Pass a tensor to a stage on the same rank (e.g. detach it into a new autograd leaf)."""

    def sent(self, node: ScheduleNode, tensor: Any) -> None:
        """Called right after ``tensor``'s send was posted (the transport keeps its data alive)."""


class Transport(Protocol):
    def isend(self, node: ScheduleNode, tensor: Any) -> Pending: ...
    def irecv(self, node: ScheduleNode, buffer: Any) -> Pending: ...
    def complete(self, pending: Pending) -> None: ...


class Recorder(Protocol):
    """Receives the start/end time of every node (``dump_pp_data``)."""

    def clock(self) -> float: ...
    def record(self, node: ScheduleNode, start: float, end: float) -> None: ...


@dataclass(frozen=True)
class _Part:
    kind: NodeKind
    microbatch: int
    chunk: int
    stage: int
    takes: Key | None
    """Inbox key this part consumes (received or handed off locally)."""
    gives: Key | None
    """Where the result goes: an outbox key (``local`` False) or another chunk's inbox key (``local`` True)."""
    local: bool
    releases: Key | None
    """For a backward part: the key of this (chunk, mb)'s activation send, certainly delivered by now."""


@dataclass(frozen=True)
class _Step:
    node: ScheduleNode
    key: Key | None  # communication nodes
    parts: tuple[_Part, ...]  # compute nodes


class ScheduleRunner:
    """Runs ``table``'s row for pipeline rank ``rank``; build once per table, call :meth:`run` per step."""

    def __init__(self, table: ScheduleTable, rank: int):
        if not table.has_communication:
            raise ConfigError("the runner needs a full table; pass it through add_communication (build_schedule does)")
        if not 0 <= rank < table.pp:
            raise ConfigError(f"rank {rank} is outside the table's pipeline of {table.pp} ranks")
        self.table = table
        self.rank = rank
        self.steps = tuple(_plan_step(table, rank, node) for node in table.ranks[rank])
        self.compute_kinds = frozenset(s.node.kind for s in self.steps if s.node.kind.is_compute)

    def check_binder(self, binder: Binder) -> None:
        missing = self.compute_kinds - set(binder.handlers)
        if missing:
            names = ", ".join(sorted(k.value for k in missing))
            have = ", ".join(sorted(k.value for k in binder.handlers)) or "none"
            raise ConfigError(
                f"the {self.table.algorithm} table has {names} nodes but {type(binder).__name__} has no handler "
                f"for them (it handles: {have}); pick an algorithm with a fused backward (BW) or a binder "
                "that splits the backward"
            )

    def run(self, binder: Binder, transport: Transport, recorder: Recorder | None = None) -> None:
        """Execute this rank's row once. Raises :class:`PipelineHangError` through the transport."""
        self.check_binder(binder)
        handlers = binder.handlers
        inbox: dict[Key, Any] = {}
        outbox: dict[Key, Any] = {}
        receiving: dict[Key, Pending] = {}
        sent_activations: dict[Key, Pending] = {}
        sending: list[Pending] = []
        clock = recorder.clock if recorder is not None else None

        def finish(pending: Pending) -> None:
            transport.complete(pending)
            if recorder is not None:
                recorder.record(pending.node, pending.posted_at, clock())

        def take(key: Key) -> Any:
            if (pending := receiving.pop(key, None)) is not None:
                finish(pending)
                return pending.tensor
            return inbox.pop(key)

        for step in self.steps:
            node = step.node
            if node.kind.is_recv:
                pending = receiving[step.key] = transport.irecv(node, binder.recv_buffer(node))
                if clock is not None:
                    pending.posted_at = clock()
                continue
            if node.kind.is_send:
                tensor = outbox.pop(step.key)
                pending = transport.isend(node, tensor)
                if clock is not None:
                    pending.posted_at = clock()
                binder.sent(node, tensor)
                if node.kind is NodeKind.SEND_F:
                    sent_activations[step.key] = pending
                else:
                    sending.append(pending)
                continue
            calls = []
            for part in step.parts:
                received = take(part.takes) if part.takes is not None else None
                if part.releases is not None and (done := sent_activations.pop(part.releases, None)):
                    finish(done)  # its gradient came back, so the peer consumed it: frees it on gloo too
                calls.append(ComputeCall(part.kind, part.microbatch, part.chunk, part.stage, received))
            start = clock() if clock is not None else 0.0
            if node.kind is NodeKind.FB:
                results = handlers[NodeKind.FB](*calls)
            else:
                results = (handlers[node.kind](calls[0]),)
            if recorder is not None:
                recorder.record(node, start, clock())
            for part, result in zip(step.parts, results):
                if part.gives is None:
                    continue
                if part.local:
                    inbox[part.gives] = binder.local_handoff(result, part.gives[0])
                else:
                    outbox[part.gives] = result
        for pending in (*receiving.values(), *sent_activations.values(), *sending):
            finish(pending)
        assert not outbox and not inbox, f"rank {self.rank}: unconsumed tensors {sorted(outbox) + sorted(inbox)}"


def _plan_step(table: ScheduleTable, rank: int, node: ScheduleNode) -> _Step:
    if not node.kind.is_compute:
        return _Step(node, (node.kind.carries, node.chunk, node.microbatch), ())
    placement = table.placement
    parts = []
    for kind, mb, chunk in node.parts():
        stage = placement.stage(rank, chunk)
        takes = gives = releases = None
        local = False
        if kind is NodeKind.F:
            if stage > 0:
                takes = ("F", chunk, mb)
            if stage < table.num_stages - 1:
                if outbound(placement, rank, kind, chunk, mb) is not None:
                    gives = ("F", chunk, mb)
                else:
                    gives, local = ("F", placement.locate(stage + 1)[1], mb), True
        elif kind in (NodeKind.B, NodeKind.BW):
            if stage < table.num_stages - 1:
                takes = ("B", chunk, mb)
                if outbound(placement, rank, NodeKind.F, chunk, mb) is not None:
                    releases = ("F", chunk, mb)
            if stage > 0:
                if outbound(placement, rank, kind, chunk, mb) is not None:
                    gives = ("B", chunk, mb)
                else:
                    gives, local = ("B", placement.locate(stage - 1)[1], mb), True
        parts.append(_Part(kind, mb, chunk, stage, takes, gives, local, releases))
    return _Step(node, None, tuple(parts))


@functools.lru_cache(maxsize=64)
def forward_only_view(table: ScheduleTable) -> ScheduleTable:
    """The table's forwards and activation transfers only, in the table's order (evaluation); an
    overlapped ``F+B`` node counts as its ``F``.

    Dropping backward nodes and gradient transfers keeps each direction's sends and receives in the
    same relative order, so pairing still holds; the view is re-checked (structure, order, pairing,
    deadlock) anyway, since completeness no longer applies.
    """
    keep = (NodeKind.F, NodeKind.FB, NodeKind.SEND_F, NodeKind.RECV_F)
    view = table.with_ranks(
        tuple(ScheduleNode(*n.parts()[0]) if n.kind is NodeKind.FB else n for n in row if n.kind in keep)
        for row in table.ranks)
    for check in (check_structure, check_order, check_pairing, check_deadlock):
        check(view)
    return view


@functools.lru_cache(maxsize=64)
def cached_runner(table: ScheduleTable, rank: int) -> ScheduleRunner:
    """One runner per (immutable) table and rank."""
    return ScheduleRunner(table, rank)
