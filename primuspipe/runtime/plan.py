"""A rank's row as the runner executes it: derived once per (table, rank) from the dependency model.

For every compute part the plan says which hand-off it takes (a receive or a same-rank hand-off, keyed
by :class:`~primuspipe.ir.dataflow.Handoff`), where its result goes (the outbox a send reads, or
another local chunk's inbox), and which of this chunk's earlier sends it proves delivered (a gradient
coming back from a stage means that stage consumed the activation sent to it). All of it comes from
:mod:`primuspipe.ir.dataflow`, so the runner executes the rules the validator proves.
"""

from __future__ import annotations

from dataclasses import dataclass

from primuspipe.ir.dataflow import Handoff, handoffs_in, handoffs_out, released_transfer
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable


@dataclass(frozen=True)
class PlannedPart:
    kind: NodeKind
    microbatch: int
    chunk: int
    stage: int
    takes: Handoff | None
    """Inbox key this part consumes (received or handed off locally)."""
    gives: Handoff | None
    """Where the result goes: an outbox key (``local`` False) or another chunk's inbox key (``local`` True)."""
    local: bool
    releases: Handoff | None
    """An outbox key of this chunk's earlier send that this part's input proves delivered."""


@dataclass(frozen=True)
class PlannedStep:
    node: ScheduleNode
    key: Handoff | None
    """Communication nodes: the hand-off they move."""
    parts: tuple[PlannedPart, ...]
    """Compute nodes: their parts."""


def plan_row(table: ScheduleTable, rank: int) -> tuple[PlannedStep, ...]:
    return tuple(_plan_step(table, rank, node) for node in table.ranks[rank])


def released_keys(steps: tuple[PlannedStep, ...]) -> frozenset[Handoff]:
    """Send keys some later part proves delivered (the runner completes those sends then)."""
    return frozenset(p.releases for s in steps for p in s.parts if p.releases is not None)


def _plan_step(table: ScheduleTable, rank: int, node: ScheduleNode) -> PlannedStep:
    if not node.kind.is_compute:
        return PlannedStep(node, Handoff(node.kind.carries, node.chunk, node.microbatch), ())
    placement = table.placement
    parts = []
    for kind, mb, chunk in node.parts():
        stage = placement.stage(rank, chunk)
        takes = gives = releases = None
        local = False
        for carries, src in handoffs_in(placement, kind, stage):
            takes = Handoff(carries, chunk, mb)
            if placement.rank_of(src) != rank:
                releases = _sent_to(table, kind, stage, src, chunk, mb)
        for carries, dst in handoffs_out(placement, kind, stage):
            dst_rank, dst_chunk = placement.locate(dst)
            local = dst_rank == rank
            gives = Handoff(carries, dst_chunk if local else chunk, mb)
        parts.append(PlannedPart(kind, mb, chunk, stage, takes, gives, local, releases))
    return PlannedStep(node, None, tuple(parts))


def _sent_to(table: ScheduleTable, kind: NodeKind, stage: int, peer_stage: int, chunk: int, mb: int) -> Handoff | None:
    """The outbox key of what this chunk sent ``peer_stage`` and a part of ``kind`` proves delivered."""
    sent = released_transfer(table.placement, kind, stage, peer_stage, mb)
    return None if sent is None else Handoff(sent.carries, chunk, mb)
