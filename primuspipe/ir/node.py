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
ScheduleNode(kind=<NodeKind.SEND_F: 'SEND_F'>, microbatch=3, chunk=1, peer=2, pair=None)
>>> str(ScheduleNode(NodeKind.BW, 0, 1))
'BW0.1'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from primuspipe.errors import TableFormatError


class NodeKind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS

    @property
    def carries(self) -> str:
        """``"F"`` for activations, ``"B"`` for gradients (communication kinds only)."""
        return _CARRIES[self]


# Looked up on every node of every pass, so kept as plain sets rather than rebuilt per call.
_COMPUTE = frozenset({NodeKind.F, NodeKind.B, NodeKind.W, NodeKind.BW, NodeKind.FB})
_SENDS = frozenset({NodeKind.SEND_F, NodeKind.SEND_B})
_RECVS = frozenset({NodeKind.RECV_F, NodeKind.RECV_B})
_CARRIES = {NodeKind.SEND_F: "F", NodeKind.RECV_F: "F", NodeKind.SEND_B: "B", NodeKind.RECV_B: "B"}

_COMPUTE_RE = re.compile(r"^(BW|F|B|W)(\d+)\.(\d+)$")
_PAIR_RE = re.compile(r"^F(\d+)\.(\d+)\+B(\d+)\.(\d+)$")
_COMM_RE = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B)(\d+)\.(\d+)([<>])(\d+)$")


@dataclass(frozen=True, slots=True)
class ScheduleNode:
    """One step of one rank's schedule.

    ``pair`` is set only on ``FB`` nodes: the ``(microbatch, chunk)`` of the input-grad backward that is
    overlapped with this node's forward.
    """

    kind: NodeKind
    microbatch: int
    chunk: int = 0
    peer: int | None = None
    pair: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.microbatch < 0 or self.chunk < 0:
            raise TableFormatError(f"{self.kind.value} node has a negative microbatch or chunk")
        if self.kind.is_compute and self.peer is not None:
            raise TableFormatError(f"compute node {self.kind.value} cannot name a peer rank")
        if not self.kind.is_compute and (self.peer is None or self.peer < 0):
            raise TableFormatError(f"communication node {self.kind.value} needs a peer rank >= 0")
        if (self.kind is NodeKind.FB) != (self.pair is not None):
            raise TableFormatError("exactly the FB kind carries a pair (microbatch, chunk) of its B part")

    def __str__(self) -> str:
        base = f"{self.kind.value}{self.microbatch}.{self.chunk}"
        if self.kind is NodeKind.FB:
            return f"F{self.microbatch}.{self.chunk}+B{self.pair[0]}.{self.pair[1]}"
        if self.kind.is_compute:
            return base
        return f"{base}{'>' if self.kind.is_send else '<'}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> ScheduleNode:
        """Parse the text form; raises :class:`TableFormatError` naming the expected forms."""
        text = text.strip()
        if m := _COMPUTE_RE.match(text):
            return cls(NodeKind(m[1]), int(m[2]), int(m[3]))
        if m := _PAIR_RE.match(text):
            return cls(NodeKind.FB, int(m[1]), int(m[2]), pair=(int(m[3]), int(m[4])))
        if m := _COMM_RE.match(text):
            kind = NodeKind(m[1])
            if (m[4] == ">") != kind.is_send:
                raise TableFormatError(f"{text!r}: sends use '>peer', receives use '<peer'")
            return cls(kind, int(m[2]), int(m[3]), peer=int(m[5]))
        raise TableFormatError(
            f"cannot parse schedule node {text!r}; expected e.g. F3.1, B3.1, W3.1, BW3.1, F3.1+B5.0, "
            "SEND_F3.1>2, RECV_B3.1<2"
        )

    def parts(self) -> tuple[tuple[NodeKind, int, int], ...]:
        """The compute steps this node performs as ``(kind, microbatch, chunk)``; an FB node has two."""
        if self.kind is NodeKind.FB:
            return ((NodeKind.F, self.microbatch, self.chunk), (NodeKind.B, *self.pair))
        if self.kind.is_compute:
            return ((self.kind, self.microbatch, self.chunk),)
        return ()


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
