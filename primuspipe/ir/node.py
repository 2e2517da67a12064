"""Schedule nodes: the immutable values a schedule table is made of.

A node names *what* runs, never *how*: the runner binds handlers to kinds, the simulator binds costs.
Every node has a short text form that parses back (``ScheduleNode.parse(str(node)) == node``):

======================  =========================================================
``F3.1``                forward of microbatch 3 on this rank's chunk 1
``B3.1`` / ``W3.1``     input-grad / weight-grad backward of microbatch 3, chunk 1
``BW3.1``               fused backward (input and weight grads together)
``F3.1+B5.0``           overlapped pair: F of mb 3 chunk 1 with B of mb 5 chunk 0
``SEND_F3.1>2``         send the activation F3.1 produced to rank 2
``RECV_F3.1<0``         receive from rank 0 the activation F3.1 consumes
``SEND_B3.1>0``         send the input grad B3.1 produced to rank 0
``RECV_B3.1<2``         receive from rank 2 the output grad B3.1 consumes
======================  =========================================================

Communication nodes name the *local* chunk they serve (the producer's for a send, the consumer's for a
receive), so a node is meaningful without the peer's table.

>>> ScheduleNode.parse("SEND_F3.1>2")
ScheduleNode(kind=NodeKind.SEND_F, microbatch=3, chunk=1, peer=2, pair=None)
>>> str(ScheduleNode(NodeKind.BW, 0, 1))
'BW0.1'
"""

from __future__ import annotations

import functools

import re
from dataclasses import dataclass
from typing import NamedTuple

from primuspipe import strict
from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind, overlapped_kind

__all__ = ["B", "BW", "F", "FB", "NodeKind", "Part", "ScheduleNode", "W"]

_SIMPLE_RE = re.compile(r"([A-Z][A-Z_]*?)([0-9]{1,12})\.([0-9]{1,12})(?:([<>])([0-9]{1,12}))?", re.ASCII)


class Part(NamedTuple):
    """One compute step a node performs: ``(kind, microbatch, chunk)``."""

    kind: NodeKind
    microbatch: int
    chunk: int


@dataclass(frozen=True, slots=True)
class ScheduleNode:
    """One step of one rank's schedule.

    ``pair`` is set only on overlapped nodes (``FB``): the ``(microbatch, chunk)`` of the second part
    (the input-grad backward overlapped with this node's forward).
    """

    kind: NodeKind
    microbatch: int
    chunk: int = 0
    peer: int | None = None
    pair: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, NodeKind):
            raise TableFormatError(f"a node's kind must be a NodeKind, got {self.kind!r}")
        if bool(self.kind.spec.parts) != (self.pair is not None) or not (
                self.pair is None or type(self.pair) is tuple and len(self.pair) == 2):
            raise TableFormatError("exactly the overlapped kinds (FB) carry a pair (microbatch, chunk) of their "
                                   "second part")
        mb, chunk, pair = self.microbatch, self.chunk, self.pair  # plain checks: every pass makes nodes by the 100k
        if not (type(mb) is int and mb >= 0 and type(chunk) is int and chunk >= 0 and (
                pair is None or type(pair[0]) is int and pair[0] >= 0 and type(pair[1]) is int and pair[1] >= 0)):
            self._whole_numbers()
        if self.kind.is_compute and self.peer is not None:
            raise TableFormatError(f"compute node {self.kind} cannot name a peer rank")
        if not self.kind.is_compute and (type(self.peer) is not int or self.peer < 0):
            raise TableFormatError(f"communication node {self.kind} needs a peer rank >= 0")

    def _whole_numbers(self) -> None:
        """Take integers of other types (numpy's) as ints; refuse a float, bool, text or negative number, which
        indexed stages and microbatches wrongly (True as microbatch 1) or deep in a pass (a float index)."""
        def whole(value: object, name: str) -> int:
            return strict.count(value, f"{self.kind} node's {name}", error=TableFormatError)

        object.__setattr__(self, "microbatch", whole(self.microbatch, "microbatch"))
        object.__setattr__(self, "chunk", whole(self.chunk, "chunk"))
        if self.pair is not None:
            object.__setattr__(self, "pair", (whole(self.pair[0], "pair microbatch"), whole(self.pair[1], "pair chunk")))

    def __str__(self) -> str:
        if self.pair is not None:
            return "+".join(f"{p.kind}{p.microbatch}.{p.chunk}" for p in self.parts())
        base = f"{self.kind}{self.microbatch}.{self.chunk}"
        if self.kind.is_compute:
            return base
        return f"{base}{'>' if self.kind.is_send else '<'}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> ScheduleNode:
        """Parse the text form; raises :class:`TableFormatError` naming the expected forms."""
        strict.instance(text, str, "a schedule node's text", error=TableFormatError)
        text = text.strip()
        if "+" in text:
            parts = [cls.parse(t) for t in text.split("+")]
            if len(parts) != 2 or any(p.peer is not None or p.pair is not None for p in parts):
                raise TableFormatError(f"cannot parse overlapped node {text!r}; expected e.g. F3.1+B5.0")
            kind = overlapped_kind(tuple(p.kind for p in parts))
            return cls(kind, parts[0].microbatch, parts[0].chunk, pair=(parts[1].microbatch, parts[1].chunk))
        m = _SIMPLE_RE.fullmatch(text)
        if m is None or m[1] not in NodeKind._table or (NodeKind(m[1]).is_compute and m[4] is not None):
            raise TableFormatError(
                f"cannot parse schedule node {text!r}; expected e.g. F3.1, B3.1, W3.1, BW3.1, F3.1+B5.0, "
                "SEND_F3.1>2, RECV_B3.1<2 (compute nodes name no peer)"
            )
        kind = NodeKind(m[1])
        if kind.is_compute:
            return cls(kind, int(m[2]), int(m[3]))
        if m[4] is None or (m[4] == ">") != kind.is_send:
            raise TableFormatError(f"{text!r}: sends use '>peer', receives use '<peer'")
        return cls(kind, int(m[2]), int(m[3]), peer=int(m[5]))

    def parts(self) -> tuple[Part, ...]:
        """The compute steps this node performs; an overlapped node has one per part."""
        if self.pair is not None:
            first, second = self.kind.parts
            return (Part(first, self.microbatch, self.chunk), Part(second, *self.pair))
        if self.kind.is_compute:
            return (Part(self.kind, self.microbatch, self.chunk),)
        return ()


@functools.lru_cache(maxsize=1 << 16)
def shared_node(kind: NodeKind, microbatch: int, chunk: int = 0, peer: int | None = None) -> ScheduleNode:
    """One node value, made once (not an overlapped one): the passes and the list scheduler build the same nodes
    many times over (a competition's fills, its candidates' sends and receives), and a node is immutable, so the
    rows share them."""
    return ScheduleNode(kind, microbatch, chunk, peer)


def F(mb: int, chunk: int = 0) -> ScheduleNode:
    return ScheduleNode(NodeKind.F, mb, chunk)


def B(mb: int, chunk: int = 0) -> ScheduleNode:
    return ScheduleNode(NodeKind.B, mb, chunk)


def W(mb: int, chunk: int = 0) -> ScheduleNode:
    return ScheduleNode(NodeKind.W, mb, chunk)


def BW(mb: int, chunk: int = 0) -> ScheduleNode:
    return ScheduleNode(NodeKind.BW, mb, chunk)


def FB(f_mb: int, f_chunk: int, b_mb: int, b_chunk: int) -> ScheduleNode:
    return ScheduleNode(NodeKind.FB, f_mb, f_chunk, pair=(b_mb, b_chunk))
