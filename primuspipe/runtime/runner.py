"""The schedule runner: executes one rank's row of a full table through a binder.

The runner knows the table and the communication semantics; the binder knows the model. It runs only
proven tables: one that :func:`~primuspipe.passes.validation.validate` has not accepted (a table built
or edited by hand, read from a file, ...) is validated first, so a table with, say, two receives
swapped is refused with the validator's message instead of training on swapped tensors. A binder is
one visible map from node kind to handler (:class:`~primuspipe.runtime.protocols.Binder`), so what runs for ``F``, ``BW``, ``B`` or
``W`` is never hidden in the runner, and a table whose kinds the binder cannot run is refused up front
with :class:`~primuspipe.errors.ConfigError`.

Semantics (exactly the ones :func:`primuspipe.passes.validation.check_deadlock` proves safe):

* a receive is posted where the table places it and never blocks; a send is posted right where the
  table places it and never blocks;
* a compute node waits only for its own inbound receives;
* per direction, the k-th send meets the k-th receive (one ordered channel per pair, see
  :mod:`primuspipe.runtime.transport`);
* everything outstanding is completed before :meth:`ScheduleRunner.run` returns.

Tensors move through explicit per-step state keyed by :class:`~primuspipe.ir.dataflow.Handoff`
``(carries, chunk, microbatch)``: a completed receive or a same-rank hand-off fills the *inbox* of the
consuming chunk; a compute part's result goes to the *outbox* its send node reads. Nothing is looked up
by searching the table, and the table is never mutated: :class:`ScheduleRunner` holds a plan
(:mod:`primuspipe.runtime.plan`) derived once from the immutable table. The runner imports no torch;
tensors are the binder's and the transport's business.

>>> from primuspipe.algorithms.build import build_schedule
>>> runner = ScheduleRunner(build_schedule("1f1b", pp=2, microbatches=2), rank=1)
>>> sorted(k.name for k in runner.compute_kinds)
['BW', 'F']
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from primuspipe.errors import ConfigError
from primuspipe.ir.dataflow import Handoff
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import is_proven, validate
from primuspipe.runtime.plan import PlannedStep, plan_row, released_keys
from primuspipe.runtime.protocols import Binder, ComputeCall, Handler, Pending, Recorder, Transport


class ScheduleRunner:
    """Runs ``table``'s row for pipeline rank ``rank``; build once per table, call :meth:`run` per step."""

    def __init__(self, table: ScheduleTable, rank: int):
        if not table.has_communication and table.pp > 1:  # one rank's table has nothing to communicate
            raise ConfigError("the runner needs a full table; pass it through add_communication (build_schedule does)")
        if not 0 <= rank < table.pp:
            raise ConfigError(f"rank {rank} is outside the table's pipeline of {table.pp} ranks")
        if not is_proven(table, complete=False):  # proof before execution; a forward-only view carries its own
            validate(table)
        self.table = table
        self.rank = rank
        self.steps: tuple[PlannedStep, ...] = plan_row(table, rank)
        self._released = released_keys(self.steps)
        self.compute_kinds = frozenset(s.node.kind for s in self.steps if s.node.kind.is_compute)

    def handlers_for(self, binder: Binder) -> dict[NodeKind, Handler]:
        """The handler of every kind in this row: the binder's own, else (for a paired kind such as FB)
        its parts' handlers run one after the other. Refuses a binder that cannot run the row, and a map
        that is not one: keys other than compute :class:`NodeKind` members (``"F"`` is not ``NodeKind.F``)
        and values that cannot be called."""
        given = _handler_map(binder)
        handlers: dict[NodeKind, Handler] = {}
        missing = set()
        for kind in self.compute_kinds:
            if kind in given:
                handlers[kind] = given[kind]
            elif kind.spec.parts and all(p in given for p in kind.parts):
                handlers[kind] = functools.partial(_run_parts_in_turn, given)
            else:
                missing.add(kind)
        if missing:
            names = ", ".join(sorted(k.name for k in missing))
            have = ", ".join(sorted(k.name for k in given)) or "none"
            fix = ("run the table without offload, or a binder that moves activations to host (the plain-torch "
                   "backend's)" if any(k.on_host_stream for k in missing) else
                   "pick an algorithm with a fused backward (BW) or a binder that splits the backward")
            raise ConfigError(
                f"the {self.table.algorithm} table has {names} nodes but {type(binder).__name__} has no handler "
                f"for them (it handles: {have}); {fix}"
            )
        return handlers

    def run(self, binder: Binder, transport: Transport, recorder: Recorder | None = None) -> None:
        """Execute this rank's row once. Raises :class:`PipelineHangError` through the transport."""
        handlers = self.handlers_for(binder)
        inbox: dict[Handoff, Any] = {}
        outbox: dict[Handoff, Any] = {}
        receiving: dict[Handoff, Pending] = {}
        awaiting_release: dict[Handoff, Pending] = {}
        sending: list[Pending] = []
        clock = recorder.clock if recorder is not None else None

        def finish(pending: Pending) -> None:
            transport.complete(pending)
            if recorder is not None:
                recorder.record(pending.node, pending.posted_at, clock(), pending.tensor)

        def take(key: Handoff) -> Any:
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
                if step.key in self._released:
                    awaiting_release[step.key] = pending
                else:
                    sending.append(pending)
                continue
            calls = []
            for part in step.parts:
                received = take(part.takes) if part.takes is not None else None
                if part.releases is not None and (done := awaiting_release.pop(part.releases, None)):
                    finish(done)  # the peer consumed it: frees it on gloo too
                calls.append(ComputeCall(part.kind, part.microbatch, part.chunk, part.stage, received))
            start = clock() if clock is not None else 0.0
            if len(calls) == 1:
                results = (handlers[node.kind](calls[0]),)
            else:
                first, *rest = calls
                results = handlers[node.kind](_with_partners(first, rest))
                if not isinstance(results, (tuple, list)) or len(results) != len(calls):
                    got = f"{len(results)} result(s)" if isinstance(results, (tuple, list)) else type(results).__name__
                    raise ConfigError(f"rank {self.rank}: the handler of {node} returned {got} for its {len(calls)} "
                                      "parts; a paired node's handler returns a tuple of one result per part")
            if recorder is not None:
                recorder.record(node, start, clock())
            for part, result in zip(step.parts, results):
                if part.gives is None:
                    continue
                if result is None:  # a send of nothing: the peer would wait for it until the watchdog
                    raise ConfigError(
                        f"rank {self.rank}: the {part.kind.name} handler returned None for microbatch "
                        f"{part.microbatch} of chunk {part.chunk} (stage {part.stage}), but the table hands its "
                        f"{'activation' if part.gives.carries is NodeKind.F else 'input gradient'} on to stage "
                        f"{part.stage + 1 if part.gives.carries is NodeKind.F else part.stage - 1}; return the tensor")
                if part.local:
                    inbox[part.gives] = binder.local_handoff(result, part.gives.carries)
                else:
                    outbox[part.gives] = result
        for pending in (*receiving.values(), *awaiting_release.values(), *sending):
            finish(pending)
        assert not outbox and not inbox, f"rank {self.rank}: unconsumed tensors {sorted(outbox) + sorted(inbox)}"


def _handler_map(binder: Binder) -> Mapping[NodeKind, Handler]:
    """``binder.handlers``, checked to be a map from compute kinds to callables."""
    given = getattr(binder, "handlers", None)
    if not isinstance(given, Mapping):
        raise ConfigError(f"{type(binder).__name__}.handlers must map node kinds to handlers (e.g. "
                          f"{{NodeKind.F: self.forward, NodeKind.BW: self.backward}}), got {type(given).__name__}")
    for kind, handler in given.items():
        if not isinstance(kind, NodeKind) or not kind.is_compute:
            known = ", ".join(k.name for k in compute_kinds())
            raise ConfigError(f"{type(binder).__name__}.handlers has the key {kind!r}; its keys are compute node "
                              f"kinds, NodeKind members ({known}), e.g. NodeKind.F, not the name 'F'")
        if not callable(handler):
            raise ConfigError(f"{type(binder).__name__}.handlers[{kind!r}] is {type(handler).__name__}, not something "
                              "to call with a ComputeCall")
    return given


def _with_partners(first: ComputeCall, rest: list[ComputeCall]) -> ComputeCall:
    """A paired node's call: its first part, the next one as its partner (and so on)."""
    partner = _with_partners(rest[0], rest[1:]) if rest else None
    return ComputeCall(first.kind, first.microbatch, first.chunk, first.stage, first.received, partner)


def _run_parts_in_turn(handlers, call: ComputeCall) -> tuple:
    """A paired node on a binder with no handler for the pair: each part through its own handler, in
    order (FB: its F, then its B). Nothing runs concurrently; the pair is only placed together."""
    results = []
    while call is not None:
        results.append(handlers[call.kind](ComputeCall(call.kind, call.microbatch, call.chunk, call.stage,
                                                       call.received)))
        call = call.partner
    return tuple(results)


@functools.lru_cache(maxsize=64)
def cached_runner(table: ScheduleTable, rank: int) -> ScheduleRunner:
    """One runner per (immutable) table and rank."""
    return ScheduleRunner(table, rank)
