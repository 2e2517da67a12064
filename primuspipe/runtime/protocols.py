"""What the runner needs from a backend and a transport: the seam every backend plugs into.

A backend supplies a :class:`Binder` -- one visible map from node kind to :data:`Handler`, plus three
small tensor hooks -- and the runner does the rest (hand-offs, communication order, completion). Every
handler has the same signature: it takes one :class:`ComputeCall` and returns what the part hands to
the neighbouring stage. A paired kind (``FB``: an F and a B the schedule places as one node, the pair
DualPipe overlaps) gets one call whose :attr:`ComputeCall.partner` is its second part and returns one
result per part -- a binder may run the two concurrently there. A binder that has no handler for the
pair (every binder shipped here) gets its parts run one after the other through their own handlers:
F, then B, no concurrency.

Nothing here imports torch: tensors are opaque to the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.node import ScheduleNode


@dataclass(frozen=True)
class ComputeCall:
    """One compute part as a handler sees it."""

    kind: NodeKind
    """The part's kind (``F``, ``B``, ``W``, ``BW``; a paired node's call has its first part's)."""
    microbatch: int
    chunk: int
    stage: int
    received: Any
    """What this part consumes from a neighbouring stage: the activation for ``F``, the output gradient
    for ``B``/``BW``; ``None`` on the first stage's ``F``, the last stage's backward, and ``W``."""
    partner: ComputeCall | None = None
    """For a paired node (``FB``): its second part, which the handler runs with this one (in turn or
    concurrently, as the binder can)."""


Handler = Callable[[ComputeCall], Any]
"""Runs one node; returns what it hands to the neighbouring stage (``F``: activation, ``B``/``BW``:
input gradient; ignored where there is no consumer), or, for a paired node, a tuple with one
result per part."""


def named_handlers(binder: object) -> dict[NodeKind, Handler]:
    """Kind -> the binder's method that the kind table names for it (:attr:`KindSpec.handler
    <primuspipe.ir.kinds.KindSpec.handler>`), for every kind whose method the binder has: a binder
    writes ``forward``, ``backward_input``... and its map follows the table."""
    return {kind: getattr(binder, kind.spec.handler) for kind in compute_kinds()
            if kind.spec.handler is not None and callable(getattr(binder, kind.spec.handler, None))}


class Binder(Protocol):
    """What the runner needs from a model backend."""

    handlers: Mapping[NodeKind, Handler]
    """Node kind -> handler (see :data:`Handler`)."""

    def recv_buffer(self, node: ScheduleNode) -> Any:
        """An empty tensor to receive ``node``'s transfer into."""

    def local_handoff(self, tensor: Any, carries: NodeKind) -> Any:
        """Pass a tensor to a stage on the same rank (e.g. detach it into a new autograd leaf)."""

    def sent(self, node: ScheduleNode, tensor: Any) -> None:
        """Called right after ``tensor``'s send was posted (the transport keeps its data alive)."""

    # Optional: ``timing_layers(recorder)``, a context manager the driver enters around a recorded step,
    # in which the binder reports each node's spans inside the model's layer stack to ``recorder.inside``
    # (the Megatron binder does; a binder that does not know the layers leaves it out).


@dataclass
class Pending:
    """A posted send or receive: the node it serves, its tensor (or tuple of tensors) and the
    transport's requests (one per tensor)."""

    node: ScheduleNode
    tensor: Any
    work: Any
    posted_at: Any = None
    """Set by a recording runner: its recorder's timestamp of the posting."""


class Transport(Protocol):
    def isend(self, node: ScheduleNode, tensor: Any) -> Pending: ...
    def irecv(self, node: ScheduleNode, buffer: Any) -> Pending: ...
    def complete(self, pending: Pending) -> None: ...


class Recorder(Protocol):
    """Receives the start/end time of every node (``dump_pp_data``). A timestamp is whatever
    :meth:`clock` returns (seconds, or a device event read only at the step's end); the runner passes
    it back to :meth:`record` untouched, with the tensor a SEND/RECV node moved."""

    def clock(self) -> Any: ...
    def record(self, node: ScheduleNode, start: Any, end: Any, tensor: Any = None) -> None: ...
