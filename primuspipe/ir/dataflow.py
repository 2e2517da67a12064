"""What each node consumes and produces: the one dependency model shared by every pass and consumer.

Everything here is derived from the kind table (:mod:`primuspipe.ir.kinds`): a compute part of kind K
on stage s completes the steps ``K.completes`` and needs the steps ``(step, s + offset)`` of
``K.needs`` first. A need on another stage is a *hand-off*: local between chunks of one rank,
otherwise a :class:`Transfer` that a SEND/RECV pair moves. The validator, the communication pass, the
simulator, the runner's plan, the list scheduler and the MILP all ask these functions, so a rule is
written once.

Steps are identified by ``Step(kind, stage, microbatch)``: ``Step(NodeKind.B, 3, 0)`` is "the input
gradient of stage 3, microbatch 0 is done" (by a B or a BW node).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from primuspipe.ir.kinds import NodeKind, all_kinds, comm_kind, on_kinds_changed
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement


class Step(NamedTuple):
    kind: NodeKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.microbatch})"


class Transfer(NamedTuple):
    """A tensor crossing ranks: the result of step ``carries`` of ``src_stage`` that ``dst_stage``
    needs (``F``: an activation, stage s -> s+1; ``B``: a gradient, s+1 -> s)."""

    carries: NodeKind
    src_stage: int
    dst_stage: int
    microbatch: int

    def __str__(self) -> str:
        what = "activation" if self.carries is NodeKind.F else "gradient"
        return f"{what} of mb {self.microbatch}, stage {self.src_stage} -> {self.dst_stage}"


class Handoff(NamedTuple):
    """A tensor passed between stages as a runner sees it: what it carries, the local chunk that
    consumes (or, for an outgoing one, produces) it, and its microbatch."""

    carries: NodeKind
    chunk: int
    microbatch: int


def steps_done(placement: Placement, rank: int, node: ScheduleNode) -> list[Step]:
    """The steps a compute node completes (an FB node completes an F and a B)."""
    return [Step(done, placement.stage(rank, chunk), mb) for kind, mb, chunk in node.parts() for done in kind.completes]


def step_needs(placement: Placement, kind: NodeKind, stage: int, mb: int) -> list[Step]:
    """Steps that must be done before this compute part may start (anywhere in the pipeline)."""
    return [Step(step, stage + offset, mb) for step, offset in _needs(kind, placement.num_stages, stage)]


@cache
def _needs(kind: NodeKind, num_stages: int, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    """``(step, offset)`` of ``kind``'s needs that exist for ``stage`` (not past either end)."""
    assert kind.is_compute and not kind.spec.parts, f"dependencies are per single compute kind, got {kind}"
    return tuple((NodeKind(step), offset) for step, offset in kind.spec.needs if 0 <= stage + offset < num_stages)


@cache
def consumers(step: NodeKind) -> tuple[tuple[NodeKind, int], ...]:
    """``(kind, offset)`` of the kinds that need ``step`` of the stage ``offset`` away from theirs."""
    return tuple((kind, offset) for kind in all_kinds() if kind.is_compute
                 for need, offset in kind.spec.needs if need == step.name)


def handoffs_in(placement: Placement, kind: NodeKind, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    """``(carries, source stage)`` of what a part of ``kind`` on ``stage`` takes from other stages."""
    return _handoffs_in(kind, placement.num_stages, stage)


def handoffs_out(placement: Placement, kind: NodeKind, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    """``(carries, destination stage)`` of what a part of ``kind`` on ``stage`` hands to other stages."""
    return _handoffs_out(kind, placement.num_stages, stage)


@cache
def _handoffs_in(kind: NodeKind, num_stages: int, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    return tuple((step, stage + offset) for step, offset in _needs(kind, num_stages, stage) if offset)


@cache
def _handoffs_out(kind: NodeKind, num_stages: int, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    out: list[tuple[NodeKind, int]] = []
    for step in kind.completes:
        for dst in sorted({stage - offset for _, offset in consumers(step) if offset}):
            if 0 <= dst < num_stages and (step, dst) not in out:
                out.append((step, dst))
    return tuple(out)


def inbound(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int) -> Transfer | None:
    """The cross-rank transfer a compute part consumes, if its input comes from another rank."""
    return _crossing(placement, rank, kind, chunk, mb, incoming=True)


def outbound(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int) -> Transfer | None:
    """The cross-rank transfer a compute part produces, if its consumer lives on another rank."""
    return _crossing(placement, rank, kind, chunk, mb, incoming=False)


def _crossing(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int, incoming: bool) -> Transfer | None:
    stage = placement.stage(rank, chunk)
    handoffs = (handoffs_in if incoming else handoffs_out)(placement, kind, stage)
    found = [Transfer(step, other, stage, mb) if incoming else Transfer(step, stage, other, mb)
             for step, other in handoffs if placement.rank_of(other) != rank]
    assert len(found) <= 1, f"{kind} moves more than one transfer each way"
    return found[0] if found else None


def required_transfers(placement: Placement, microbatches: int) -> set[Transfer]:
    """Every transfer a complete table of this shape must move."""
    out = set()
    for kind in all_kinds():
        if not kind.is_compute or kind.spec.parts or kind.spec.optional:
            continue
        for stage in range(placement.num_stages):
            for step, src in handoffs_in(placement, kind, stage):
                if placement.rank_of(src) != placement.rank_of(stage):
                    out |= {Transfer(step, src, stage, mb) for mb in range(microbatches)}
    return out


def transfer_of(placement: Placement, rank: int, node: ScheduleNode) -> Transfer:
    """The transfer a communication node moves, derived from the local chunk it names."""
    stage = placement.stages[rank][node.chunk]
    peer_stage = stage + node.kind.spec.peer_offset
    src, dst = (stage, peer_stage) if node.kind.is_send else (peer_stage, stage)
    return Transfer(node.kind.carries, src, dst, node.microbatch)


def comm_node(placement: Placement, transfer: Transfer, send: bool) -> ScheduleNode:
    """The SEND (on the source rank) or RECV (on the destination rank) node for ``transfer``."""
    local, remote = (transfer.src_stage, transfer.dst_stage) if send else (transfer.dst_stage, transfer.src_stage)
    _, chunk = placement.locate(local)
    return ScheduleNode(comm_kind(send, transfer.carries), transfer.microbatch, chunk, peer=placement.rank_of(remote))


@cache
def reaches(num_stages: int) -> frozenset[tuple[Step, Step]]:
    """Within one microbatch, the pairs ``(a, b)`` of steps (microbatch 0) where ``b`` depends,
    directly or transitively, on ``a``; reflexive. Microbatch-ordered searches (the MILP) use it to
    know which orders every schedule shares."""
    steps = [Step(k, s, 0) for k in (NodeKind.F, NodeKind.B, NodeKind.W) for s in range(num_stages)]
    needs = {step: _step_needs(step, num_stages) for step in steps}
    closure: dict[Step, set[Step]] = {}

    def ancestors(step: Step) -> set[Step]:
        if step not in closure:
            closure[step] = {step}.union(*(ancestors(n) for n in needs[step]))
        return closure[step]

    return frozenset((a, b) for b in steps for a in ancestors(b))



def _step_needs(step: Step, num_stages: int) -> list[Step]:
    """What completing ``step`` needs: the needs of the single kind that completes only that step."""
    (kind,) = [k for k in all_kinds() if k.is_compute and k.spec.completes == (step.kind.name,)]
    return [Step(s, step.stage + offset, 0) for s, offset in _needs(kind, num_stages, step.stage)]


def _clear_caches() -> None:
    """What is derived from the kind table is cached; a new kind can change it."""
    for cached in (_needs, consumers, _handoffs_in, _handoffs_out, reaches):
        cached.cache_clear()


on_kinds_changed(_clear_caches)
