"""Node kinds as data: one table entry per kind, read by every pass and every consumer.

A kind's properties live here and nowhere else: its category (compute, send, receive), the pipeline
*steps* it completes and the steps it needs first (the dependency model, :mod:`primuspipe.ir.dataflow`,
derives every hand-off and transfer from them), its effect on held activations (the one activation
counter, :mod:`primuspipe.ir.activations`), the cost-model field that times it, its action in
torch.distributed.pipelining's CSV, and how drawings show it. The validator, the communication pass,
the simulator, the runner's plan, the formats and pp_vis all read this table.

A *step* is "kind K is done for (stage, microbatch)"; steps are named by the compute kinds ``F``
(forward), ``B`` (input gradient) and ``W`` (weight gradient). ``BW`` completes both ``B`` and ``W``;
``FB`` runs an ``F`` and a ``B`` of two microbatches as one node, ``FBW`` an ``F`` and a ``BW`` (torch's
``OVERLAP_F_B`` with a full backward, as its DualPipeV writes).

The dependency rules, as ``needs`` entries ``(step, stage offset)`` (docs/design.md §2):

======  ===============================  ================================================
kind    completes                        needs
======  ===============================  ================================================
F       F                                F of the previous stage (its activation)
B       B                                F of its own stage, B of the next stage (gradient)
W       W                                B of its own stage
BW      B, W                             as B
FB      (its parts: F, then B)           (its parts')
FBW     (its parts: F, then BW)          (its parts')
OFFLOAD OFFLOAD                          F of its own stage
RELOAD  RELOAD                           OFFLOAD of its own stage
======  ===============================  ================================================

``OFFLOAD`` and ``RELOAD`` are resource actions made first-class nodes (as torch.pipelining's
``UNSHARD``/``RESHARD`` are actions of its lowered programs): they move the activations a microbatch's
F saved on a chunk to host memory and back, on the rank's copy streams, not its compute stream
(``stream="host"``). Both are optional (a table offloads what it chooses); when a (stage, microbatch)
is offloaded, its backward must run after its reload (the validator's offload rule,
:func:`primuspipe.passes.validation.check_offload`). docs/offload.md.

A need on another stage is a hand-off: local when both stages live on one rank, otherwise a transfer
(``SEND_*`` / ``RECV_*``, named after the step whose result they carry). The first and last stage
drop the needs that fall off the pipeline (the last stage's B starts from its own loss).

Adding a kind is one :func:`define_kind` call here (or in a plug-in) plus a handler in the binder
that runs it; ``tests/core/test_kinds.py`` adds a free toy kind that way, ``tests/core/test_timed_kind.py``
one with its own cost key (timed from a cost file's ``compute`` section). Code that needs the split
backward's kinds asks this table (:func:`split_kinds`, :func:`step_kind`, :func:`kinds_completing`,
``is_input_grad`` / ``is_weight_grad``) rather than naming them.

>>> NodeKind("BW").spec.completes
('B', 'W')
>>> [k.name for k in compute_kinds()]
['F', 'B', 'W', 'BW', 'FB', 'FBW', 'OFFLOAD', 'RELOAD']
"""

from __future__ import annotations

import functools
import math
import re

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from primuspipe import strict
from primuspipe.errors import TableFormatError


class Category(Enum):
    COMPUTE = "compute"
    SEND = "send"
    RECV = "recv"


_NAME = re.compile(r"[A-Z][A-Z_]*", re.ASCII)
_COST_KEY = re.compile(r"[a-z][a-z0-9_]*", re.ASCII)
_COLOR = re.compile(r"#[0-9a-fA-F]{6}", re.ASCII)


@dataclass(frozen=True)
class KindSpec:
    """Everything primuspipe knows about one node kind."""

    name: str
    """The kind's name and the prefix of its nodes' text form (``F3.1``, ``SEND_F3.1>2``)."""
    category: Category
    label: str
    """What the kind does, for people (legends, ``--help``)."""
    completes: tuple[str, ...] = ()
    """The steps this kind completes for its (stage, microbatch)."""
    needs: tuple[tuple[str, int], ...] = ()
    """``(step, stage offset)`` that must be done before it may start (see the module docstring)."""
    parts: tuple[str, ...] = ()
    """For a kind that runs several compute kinds of different microbatches as one node (``FB``):
    those kinds, in the order they run. Its text form joins the parts with ``+``."""
    optional: bool = False
    """True if a table need not run this kind's steps for every (stage, microbatch) (the validator's
    completeness rule then asks for at most one); the F/B/W steps are required."""
    activation: tuple[float, float] = (0.0, 0.0)
    """Effect on the activations held for its (stage, microbatch), as ``(a, b)``: the held amount
    changes by ``a + b * retained``, where ``retained`` is the share of the activations a deferred W
    still needs. F takes one (``+1``); B frees all but the retained share; W frees that share; BW
    frees everything. With ``retained = 0`` this counts a microbatch from its F until its B."""
    rise: float = 0.0
    """How far the held amount rises while the kind runs, before its :attr:`activation` effect, per share
    ``rise`` of the activations (the cost model's ``memory.b_rise_fraction``): a split-backward B keeps for
    its W the inputs and output gradients of every weight GEMM it has passed, which a fused backward frees
    as it walks down the layers, so B peaks above what it started with (``1``); every other kind ``0``."""
    offload: float = 0.0
    """Effect on the activations held, per share of them a host copy moves (``offloaded``, the cost
    model's ``memory.offload_fraction``): OFFLOAD ``-1`` (they leave the device), RELOAD ``+1``."""
    stream: str = "compute"
    """Where the kind runs: ``compute`` (the rank's compute stream, one node at a time) or ``host``
    (the rank's copy streams to and from host memory, overlapping compute: OFFLOAD, RELOAD)."""
    cost: str | None = None
    """The key of this kind's per-stage time in the cost model (``f``, ``b``, ``w``, ``bw``, or a new
    kind's own, e.g. ``recompute``), which is also its key in a cost file's ``compute`` section; an
    overlapped kind costs its parts through the model's overlap rule; None: takes no compute time."""
    carries: str | None = None
    """Communication kinds: the step whose result the tensor is (``F``: activation, ``B``: gradient)."""
    peer_offset: int = 0
    """Communication kinds: where the peer's stage is, relative to the local one (``SEND_F``: +1)."""
    torch_action: str | None = None
    """The action's type in torch.distributed.pipelining's CSV (``I`` is torch's input-grad backward,
    ``B`` its full backward)."""
    primus_type: str | None = None
    """The node's type in the table Primus prints (its ``FuncType`` member: ``F``, ``SF``, ``O``...); None: a
    kind Primus has no type for, which the Primus form cannot write."""
    color: str = "#7f7f7f"
    """Drawing colour (pp_vis)."""
    handler: str | None = None
    """The binder method that runs a node of this kind (``forward``, ``backward_input``...): binders
    build their handler maps from it (:func:`primuspipe.runtime.protocols.named_handlers`); None: a
    binder that runs the kind adds its handler itself (OFFLOAD and RELOAD, with an offload plan)."""

    def __post_init__(self) -> None:
        """A plug-in's spec is checked when made (types first, :func:`strict.fields`): a category given as text, a
        NaN activation effect, a stream or a cost key no consumer knows were taken as they stood and ran as
        something else (a compute kind read as a receive) or failed in the first pass that read them."""
        strict.fields(self, error=TableFormatError)
        if not _NAME.fullmatch(self.name):
            raise TableFormatError(f"a node kind's name is ASCII upper-case letters and '_' (the text form's prefix, "
                                   f"F3.1), got {self.name!r}")
        problems = [
            (not all(_NAME.fullmatch(step) for step in (*self.completes, *(s for s, _ in self.needs), *self.parts)),
             "completes, needs and parts name steps and kinds (upper-case names, e.g. 'F')"),
            (len(self.parts) not in (0, 2), "parts lists the two kinds an overlapped node runs, or none"),
            (not all(map(math.isfinite, (*self.activation, self.rise, self.offload))),
             "activation, rise and offload must be finite numbers"),
            (self.stream not in ("compute", "host"), f"stream must be 'compute' or 'host', got {self.stream!r}"),
            (self.cost is not None and not _COST_KEY.fullmatch(self.cost),
             f"cost is a cost file's compute key (lower-case, e.g. 'recompute'), got {self.cost!r}"),
            (self.handler is not None and not (self.handler.isascii() and self.handler.isidentifier()),
             f"handler is a binder method's name, got {self.handler!r}"),
            (not _COLOR.fullmatch(self.color), f"color is '#rrggbb', got {self.color!r}"),
            ((self.category is Category.COMPUTE) != (self.carries is None)
             or (self.category is Category.COMPUTE) != (self.peer_offset == 0),
             "a send or receive kind names the step it carries (carries='F') and a peer_offset (+1 or -1); a "
             "compute kind neither"),
        ]
        if why := next((why for bad, why in problems if bad), None):
            raise TableFormatError(f"node kind {self.name}: {why}")

    def activation_delta(self, retained: float = 0.0, offloaded: float = 1.0) -> float:
        """How much this kind changes the activations held (see :attr:`activation`, :attr:`offload`)."""
        a, b = self.activation
        return a + b * retained + self.offload * offloaded


class NodeKind:
    """A node kind: a name whose properties are its :class:`KindSpec` in the kind table.

    Kinds are interned (``NodeKind("F") is NodeKind.F``), compare by identity and pickle by name.
    """

    __slots__ = ("name", "spec", "is_compute", "is_send", "is_recv", "on_host_stream", "is_input_grad",
                 "is_weight_grad")
    _table: ClassVar[dict[str, NodeKind]] = {}

    F: ClassVar[NodeKind]
    B: ClassVar[NodeKind]
    W: ClassVar[NodeKind]
    BW: ClassVar[NodeKind]
    FB: ClassVar[NodeKind]
    FBW: ClassVar[NodeKind]
    OFFLOAD: ClassVar[NodeKind]
    RELOAD: ClassVar[NodeKind]
    SEND_F: ClassVar[NodeKind]
    RECV_F: ClassVar[NodeKind]
    SEND_B: ClassVar[NodeKind]
    RECV_B: ClassVar[NodeKind]

    name: str
    spec: KindSpec
    is_compute: bool
    is_send: bool
    is_recv: bool
    on_host_stream: bool
    """The kind's category, and whether it runs on the host-copy streams (OFFLOAD, RELOAD: compute-category
    nodes that use no compute time), as flags set once from its spec: passes ask them for every node."""
    is_input_grad: bool
    """Whether it completes the input-gradient step (B, BW): the backward that consumes the activations."""
    is_weight_grad: bool
    """Whether it completes the weight-gradient step (W, BW): a stage's gradients are whole after its last."""

    def __new__(cls, name: str) -> NodeKind:
        try:
            return cls._table[name]
        except (KeyError, TypeError):
            raise TableFormatError(f"unknown node kind {name!r}; known kinds: {', '.join(cls._table)}") from None

    def __repr__(self) -> str:
        return f"NodeKind.{self.name}"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self):
        return NodeKind, (self.name,)

    def __lt__(self, other: NodeKind) -> bool:
        return self.name < other.name

    @property
    def carries(self) -> NodeKind:
        """The step whose result a communication node moves (``F``: activation, ``B``: gradient)."""
        assert self.spec.carries is not None, f"{self.name} carries no tensor"
        return NodeKind(self.spec.carries)

    @property
    def parts(self) -> tuple[NodeKind, ...]:
        """The compute kinds this kind runs: itself, or an overlapped kind's parts."""
        return _kinds(self.spec.parts) or (self,)

    @property
    def completes(self) -> tuple[NodeKind, ...]:
        return _kinds(self.spec.completes)


@functools.cache
def _kinds(names: tuple[str, ...]) -> tuple[NodeKind, ...]:
    """The kinds of ``names``, looked up once (validation asks per node; cleared when kinds change)."""
    return tuple(NodeKind(n) for n in names)


_listeners: list[Callable[[], object]] = [_kinds.cache_clear]
_INPUT_GRAD, _WEIGHT_GRAD = "B", "W"
"""The backward's two steps, by name (their kinds are defined below)."""


def on_kinds_changed(listener: Callable[[], object]) -> None:
    """Call ``listener`` whenever a kind is defined or forgotten (modules that cache what they derive
    from the table clear their caches)."""
    _listeners.append(listener)


def define_kind(spec: KindSpec) -> NodeKind:
    """Add ``spec`` to the kind table and return its kind; a name can be defined once."""
    strict.instance(spec, KindSpec, "define_kind's spec", error=TableFormatError)
    if spec.name in NodeKind._table:
        raise TableFormatError(f"node kind {spec.name!r} is already defined")
    if bad := next((s for s in spec.completes if s != spec.name and s not in NodeKind._table), None):
        raise TableFormatError(f"node kind {spec.name}: it completes step {bad!r}, but a step is named by the kind "
                               f"that runs it (its own name, {spec.name!r}, or one of {', '.join(NodeKind._table)})")
    steps = {step for kind in NodeKind._table.values() for step in kind.spec.completes} | set(spec.completes)
    unknown = [s for s, _ in spec.needs if s not in steps] + [s for s in (spec.carries,) if s and s not in steps]
    if unknown:
        raise TableFormatError(f"node kind {spec.name}: no kind completes step {unknown[0]!r} its needs or carries "
                               f"name; steps: {', '.join(sorted(steps))}")
    if bad := next((p for p in spec.parts if p not in NodeKind._table or not NodeKind._table[p].is_compute
                    or NodeKind._table[p].spec.parts), None):
        raise TableFormatError(f"node kind {spec.name}: part {bad!r} is no defined compute kind of one part; "
                               f"compute kinds: {', '.join(k.name for k in compute_kinds() if not k.spec.parts)}")
    kind = object.__new__(NodeKind)
    kind.name, kind.spec = spec.name, spec
    kind.is_compute = spec.category is Category.COMPUTE
    kind.is_send = spec.category is Category.SEND
    kind.is_recv = spec.category is Category.RECV
    kind.on_host_stream = spec.stream == "host"
    kind.is_input_grad, kind.is_weight_grad = _INPUT_GRAD in spec.completes, _WEIGHT_GRAD in spec.completes
    NodeKind._table[spec.name] = kind
    for listener in _listeners:
        listener()
    return kind


def forget_kind(kind: NodeKind) -> None:
    """Remove a kind :func:`define_kind` added (for tests and plug-ins that clean up)."""
    del NodeKind._table[kind.name]
    for listener in _listeners:
        listener()


def all_kinds() -> Iterator[NodeKind]:
    """Every defined kind, in definition order."""
    return iter(list(NodeKind._table.values()))


def compute_kinds() -> list[NodeKind]:
    return [k for k in all_kinds() if k.is_compute]


@functools.cache
def split_kinds() -> tuple[NodeKind, ...]:
    """The kinds that each complete one required step, in table order (``F``, ``B``, ``W``): what a
    split-backward schedule runs for every (stage, microbatch), and what the schedulers that build
    one place (the list scheduler, the building blocks, the MILP)."""
    return tuple(k for k in compute_kinds() if len(k.spec.completes) == 1 and not k.spec.optional and not k.spec.parts)


on_kinds_changed(split_kinds.cache_clear)


def step_kind(step: NodeKind) -> NodeKind:
    """The kind that completes ``step`` alone (``B`` for the ``B`` step): a fused kind (``BW``) splits
    into the step kinds of its :attr:`~NodeKind.completes`."""
    for kind in compute_kinds():
        if kind.completes == (step,) and not kind.spec.parts:
            return kind
    raise AssertionError(f"no kind completes step {step} alone")


def kinds_completing(step: NodeKind) -> tuple[NodeKind, ...]:
    """Every compute kind that completes ``step`` (``W``: ``W`` and ``BW``), in table order."""
    return tuple(k for k in compute_kinds() if step in k.completes)


def comm_kind(send: bool, carries: NodeKind) -> NodeKind:
    """The SEND (``send``) or RECV kind that moves the result of step ``carries``."""
    category = Category.SEND if send else Category.RECV
    for kind in all_kinds():
        if kind.spec.category is category and kind.spec.carries == carries.name:
            return kind
    raise AssertionError(f"no {category.value} kind carries {carries}")


def overlapped_kind(parts: tuple[NodeKind, ...]) -> NodeKind:
    """The kind that runs ``parts`` as one node (``(F, B)`` -> ``FB``)."""
    names = tuple(p.name for p in parts)
    for kind in all_kinds():
        if kind.spec.parts == names:
            return kind
    raise TableFormatError(f"no node kind overlaps {'+'.join(names)}; overlapped kinds: "
                           f"{', '.join('+'.join(k.spec.parts) for k in all_kinds() if k.spec.parts) or 'none'}")


_PREVIOUS, _NEXT = -1, 1

NodeKind.F = define_kind(KindSpec(
    "F", Category.COMPUTE, "forward", completes=("F",), needs=(("F", _PREVIOUS),),
    activation=(1.0, 0.0), cost="f", torch_action="F", primus_type="F", color="#4C72B0", handler="forward"))
NodeKind.B = define_kind(KindSpec(
    "B", Category.COMPUTE, "input grad", completes=("B",), needs=(("F", 0), ("B", _NEXT)),
    activation=(-1.0, 1.0), rise=1.0, cost="b", torch_action="I", primus_type="B", color="#55A868",
    handler="backward_input"))
NodeKind.W = define_kind(KindSpec(
    "W", Category.COMPUTE, "weight grad", completes=("W",), needs=(("B", 0),),
    activation=(0.0, -1.0), cost="w", torch_action="W", primus_type="W", color="#DD8452", handler="backward_weight"))
NodeKind.BW = define_kind(KindSpec(
    "BW", Category.COMPUTE, "fused backward", completes=("B", "W"), needs=(("F", 0), ("B", _NEXT)),
    activation=(-1.0, 0.0), cost="bw", torch_action="B", primus_type="BW", color="#8172B3", handler="backward"))
NodeKind.FB = define_kind(KindSpec(
    "FB", Category.COMPUTE, "forward + backward", parts=("F", "B"), torch_action="OVERLAP_F_B",
    color="#C44E52"))
NodeKind.FBW = define_kind(KindSpec(
    "FBW", Category.COMPUTE, "forward + fused backward", parts=("F", "BW"), torch_action="OVERLAP_F_B",
    color="#937860"))
NodeKind.OFFLOAD = define_kind(KindSpec(
    "OFFLOAD", Category.COMPUTE, "offload activations to host", completes=("OFFLOAD",), needs=(("F", 0),),
    optional=True, offload=-1.0, stream="host", primus_type="O", color="#b0b0b0"))
NodeKind.RELOAD = define_kind(KindSpec(
    "RELOAD", Category.COMPUTE, "reload activations from host", completes=("RELOAD",), needs=(("OFFLOAD", 0),),
    optional=True, offload=1.0, stream="host", primus_type="R", color="#606060"))
NodeKind.SEND_F = define_kind(KindSpec(
    "SEND_F", Category.SEND, "send activation", carries="F", peer_offset=_NEXT, torch_action="SEND_F",
    primus_type="SF"))
NodeKind.RECV_F = define_kind(KindSpec(
    "RECV_F", Category.RECV, "receive activation", carries="F", peer_offset=_PREVIOUS, torch_action="RECV_F",
    primus_type="RF"))
NodeKind.SEND_B = define_kind(KindSpec(
    "SEND_B", Category.SEND, "send gradient", carries="B", peer_offset=_PREVIOUS, torch_action="SEND_B",
    primus_type="SB"))
NodeKind.RECV_B = define_kind(KindSpec(
    "RECV_B", Category.RECV, "receive gradient", carries="B", peer_offset=_NEXT, torch_action="RECV_B",
    primus_type="RB"))
