"""What each node consumes and produces: the one dependency model shared by every pass and consumer.

Rules (DESIGN.md §2): F(s, i) needs F(s-1, i); B(s, i) and BW(s, i) need F(s, i) and the gradient of
B(s+1, i) (the last stage only its own F, i.e. the loss); W(s, i) needs B(s, i). A hand-off between
stages on different ranks is a :class:`Transfer`; between chunks of one rank it stays local.

Steps are identified by ``Step(kind, stage, microbatch)`` with kind ``"F"``, ``"B"`` (input grad
done, by B or BW) or ``"W"`` (weight grad done, by W or BW).
"""

from __future__ import annotations

from typing import NamedTuple

from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.ir.placement import Placement


class Step(NamedTuple):
    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.microbatch})"


class Transfer(NamedTuple):
    """A tensor crossing ranks: activations (``"F"``, stage s -> s+1) or gradients (``"B"``, s+1 -> s)."""

    carries: str
    src_stage: int
    dst_stage: int
    microbatch: int

    def __str__(self) -> str:
        what = "activation" if self.carries == "F" else "gradient"
        return f"{what} of mb {self.microbatch}, stage {self.src_stage} -> {self.dst_stage}"


_DONE_BY = {NodeKind.F: ("F",), NodeKind.B: ("B",), NodeKind.W: ("W",), NodeKind.BW: ("B", "W")}


def steps_done(placement: Placement, rank: int, node: ScheduleNode) -> list[Step]:
    """The steps a compute node completes (an FB node completes an F and a B)."""
    return [
        Step(k, placement.stage(rank, chunk), mb)
        for kind, mb, chunk in node.parts()
        for k in _DONE_BY[kind]
    ]


def step_needs(placement: Placement, kind: NodeKind, stage: int, mb: int) -> list[Step]:
    """Steps that must be done before this compute part may start (anywhere in the pipeline)."""
    last = placement.num_stages - 1
    if kind is NodeKind.F:
        return [Step("F", stage - 1, mb)] if stage > 0 else []
    if kind in (NodeKind.B, NodeKind.BW):
        needs = [Step("F", stage, mb)]
        return needs + [Step("B", stage + 1, mb)] if stage < last else needs
    if kind is NodeKind.W:
        return [Step("B", stage, mb)]
    raise AssertionError(f"step_needs takes a single compute kind, got {kind}")


def inbound(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int) -> Transfer | None:
    """The cross-rank transfer a compute part consumes, if its input comes from another rank."""
    stage = placement.stage(rank, chunk)
    if kind is NodeKind.F and stage > 0 and placement.rank_of(stage - 1) != rank:
        return Transfer("F", stage - 1, stage, mb)
    if kind in (NodeKind.B, NodeKind.BW) and stage < placement.num_stages - 1 and placement.rank_of(stage + 1) != rank:
        return Transfer("B", stage + 1, stage, mb)
    return None


def outbound(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int) -> Transfer | None:
    """The cross-rank transfer a compute part produces, if its consumer lives on another rank."""
    stage = placement.stage(rank, chunk)
    if kind is NodeKind.F and stage < placement.num_stages - 1 and placement.rank_of(stage + 1) != rank:
        return Transfer("F", stage, stage + 1, mb)
    if kind in (NodeKind.B, NodeKind.BW) and stage > 0 and placement.rank_of(stage - 1) != rank:
        return Transfer("B", stage, stage - 1, mb)
    return None


def transfer_of(placement: Placement, rank: int, node: ScheduleNode) -> Transfer:
    """The transfer a communication node moves, derived from the local chunk it names."""
    stage = placement.stages[rank][node.chunk]
    carries, delta, is_send = _COMM_SHAPE[node.kind]
    src, dst = (stage, stage + delta) if is_send else (stage + delta, stage)
    return Transfer(carries, src, dst, node.microbatch)


_COMM_SHAPE = {  # kind -> (carries, offset of the peer's stage, is a send)
    NodeKind.SEND_F: ("F", 1, True), NodeKind.RECV_F: ("F", -1, False),
    NodeKind.SEND_B: ("B", -1, True), NodeKind.RECV_B: ("B", 1, False),
}


def comm_node(placement: Placement, transfer: Transfer, send: bool) -> ScheduleNode:
    """The SEND (on the source rank) or RECV (on the destination rank) node for ``transfer``."""
    local, remote = (transfer.src_stage, transfer.dst_stage) if send else (transfer.dst_stage, transfer.src_stage)
    kind = NodeKind(("SEND_" if send else "RECV_") + transfer.carries)
    _, chunk = placement.locate(local)
    return ScheduleNode(kind, transfer.microbatch, chunk, peer=placement.rank_of(remote))
