"""Greedy list scheduling of split-backward (F / B / W) nodes under a per-rank activation cap.

The zero-bubble papers build their schedules the same way once the memory budget is fixed: every rank
runs, whenever it is free, the most useful node that can start now — a backward (frees memory and feeds
the backward wave) or a forward (feeds the forward wave) — and spends any wait on a deferred weight-grad
W, whose only dependant is the optimizer. The memory cap alone shapes the phases:

* warm-up: forwards until the rank holds ``cap`` activations (so the cap *is* the warm-up count);
* steady: a backward frees a slot, a forward takes it, and W's fill the gaps between arrivals;
* cool-down: the remaining backwards, with the deferred W's filling the waits and draining at the end.

Decisions are taken against the real per-stage costs (and P2P time), so non-uniform F/B/W costs move
the W's into the gaps they actually fit. The result is a feasible timed execution of the order it
returns, so its makespan is an upper bound on what an as-soon-as-possible simulation of the same table
reports.

Forwards and backwards of one chunk run in microbatch order (microbatches are interchangeable, so an
exchange argument shows this loses nothing); W's run in the order their B's finished.

A :class:`FixedOrder` policy instead takes each rank's F/B order from a constructed schedule (e.g. a
repeated building block) and leaves the scheduler only the W's: the order fixes the activation
memory, the fill squeezes the constructed timing to as-soon-as-possible and moves W's into the waits.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from primuspipe.ir.costs import ComputeCosts
from primuspipe.ir.dataflow import step_needs
from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable


_SCHEDULED = (NodeKind.F, NodeKind.B, NodeKind.W)
"""The kinds this scheduler places: a split backward, one node per step."""


@dataclass(frozen=True)
class FillPolicy:
    """How a free rank picks its next node.

    ``cap[r]`` bounds the activations rank ``r`` holds (forward done, input-grad B not yet), counted in
    *chunk* activations, and, unless ``pending_w`` says otherwise, also the weight-grad W's it may keep
    pending: a W needs the inputs of every GEMM, most of a layer's activations, so W's are deferred only
    while fewer than that many wait, which keeps memory bounded independently of the number of
    microbatches. ``reserve`` slots stay free for forwards of the rank's last chunk: a V-shape
    rank that filled its memory with chunk-0 forwards could never run the chunk-1 forward that starts
    the backward wave. ``backward_first`` breaks a tie between a ready B and a ready F.
    """

    cap: tuple[int, ...]
    reserve: int = 0
    backward_first: bool = True
    pending_w: tuple[int, ...] | None = None
    """Per rank, how many W's may wait at once, if not ``cap``."""

    def w_limit(self, rank: int) -> int:
        return (self.pending_w or self.cap)[rank]


@dataclass(frozen=True)
class FixedOrder:
    """Every rank runs its F's and B's in a given order; only the W's are placed by the fill.

    ``sequence[r]`` lists rank ``r``'s F and B nodes as (kind, chunk); the microbatch of each is implied
    (one chunk's forwards and backwards run in microbatch order). ``pending_w`` bounds the W's a rank
    keeps pending, as in :class:`FillPolicy`: a forward waits for a W to run first when that many wait.
    """

    sequence: tuple[tuple[tuple[NodeKind, int], ...], ...]
    pending_w: int

    def w_limit(self, rank: int) -> int:
        return self.pending_w


@dataclass(frozen=True)
class TimedRows:
    """The per-rank node order the scheduler chose and the makespan its own timing gives (policies are
    compared by it; the simulator measures the chosen table)."""

    rows: tuple[tuple[ScheduleNode, ...], ...]
    makespan: float


def unit_costs(num_stages: int) -> ComputeCosts:
    """F = B = W = 1 on every stage: the costs shape-only algorithms plan with."""
    return ComputeCosts.per_stage(num_stages, 1.0, 1.0, 1.0)


def list_schedule(
    placement: Placement,
    microbatches: int,
    costs: ComputeCosts,
    policy: FillPolicy | FixedOrder,
    *,
    p2p_time: float = 0.0,
    algorithm: str = "list-schedule",
) -> TimedRows:
    """Greedy event-driven schedule (see the module doc); raises ScheduleShapeError if the caps stall it."""
    pp, vpp, m = placement.pp, placement.vpp, microbatches
    fixed = isinstance(policy, FixedOrder)
    assert len(policy.sequence if fixed else policy.cap) == pp
    for r, cap in enumerate(() if fixed else policy.cap):
        if cap < 1 + policy.reserve:
            raise ScheduleShapeError(
                f"{algorithm}: rank {r} may hold {cap} chunk activations, but needs at least "
                f"{1 + policy.reserve} to make progress; raise the memory limit"
            )
    last_chunk = vpp - 1
    finish: dict[tuple[NodeKind, int, int], float] = {}  # (step kind, stage, mb) -> end time
    clock = [0.0] * pp
    held = [0] * pp
    next_f = [[0] * vpp for _ in range(pp)]
    next_b = [[0] * vpp for _ in range(pp)]
    w_queue: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
    rows: list[list[ScheduleNode]] = [[] for _ in range(pp)]
    remaining = [len(_SCHEDULED) * m * vpp] * pp

    durations = {kind: costs.of(kind) for kind in _SCHEDULED}
    # (kind, stage) -> [(needed step kind, needed stage, delay)]: dataflow's rules, resolved once
    needs = {
        (kind, placement.stage(r, c)): [
            (need.kind, need.stage, p2p_time if placement.rank_of(need.stage) != r else 0.0)
            for need in step_needs(placement, kind, placement.stage(r, c), 0)
        ]
        for kind in _SCHEDULED for r in range(pp) for c in range(vpp)
    }

    def ready_time(kind: NodeKind, stage: int, mb: int) -> float | None:
        """When the inputs of this node are available on its rank; None while a producer is unscheduled."""
        t = 0.0
        for need_kind, need_stage, delay in needs[(kind, stage)]:
            done = finish.get((need_kind, need_stage, mb))
            if done is None:
                return None
            t = max(t, done + delay)
        return t

    def candidates(rank: int) -> list[tuple[NodeKind, int, int, float | None]]:
        """(kind, chunk, mb, ready) for the next F and B of each chunk that the memory cap allows, or
        the rank's next node of a fixed order."""
        if fixed:
            done = sum(next_f[rank]) + sum(next_b[rank])
            if done == len(policy.sequence[rank]):
                return []
            kind, c = policy.sequence[rank][done]
            if kind is NodeKind.F and len(w_queue[rank]) >= policy.w_limit(rank):
                return []  # a deferred W must run first
            mb = (next_f if kind is NodeKind.F else next_b)[rank][c]
            return [(kind, c, mb, ready_time(kind, placement.stage(rank, c), mb))]
        out = []
        for c in range(vpp):
            stage = placement.stage(rank, c)
            mb = next_b[rank][c]
            if mb < next_f[rank][c]:
                out.append((NodeKind.B, c, mb, ready_time(NodeKind.B, stage, mb)))
            mb = next_f[rank][c]
            room = policy.cap[rank] - (0 if c == last_chunk else policy.reserve)
            if mb < m and held[rank] + 1 <= room and len(w_queue[rank]) < policy.w_limit(rank):
                out.append((NodeKind.F, c, mb, ready_time(NodeKind.F, stage, mb)))
        return out

    def run(rank: int, kind: NodeKind, chunk: int, mb: int, start: float) -> None:
        stage = placement.stage(rank, chunk)
        end = start + durations[kind][stage]
        finish[(kind, stage, mb)] = end
        clock[rank] = end
        remaining[rank] -= 1
        rows[rank].append(ScheduleNode(kind, mb, chunk))
        held[rank] += kind.spec.activation_delta()
        if kind is NodeKind.F:
            next_f[rank][chunk] += 1
        elif kind is NodeKind.B:
            next_b[rank][chunk] += 1
            w_queue[rank].append((mb, chunk))

    def w_cost(rank: int) -> float:
        return costs.backward_weight[placement.stage(rank, w_queue[rank][0][1])]

    kind_rank = {NodeKind.B: 0, NodeKind.F: 1} if fixed or policy.backward_first else {NodeKind.F: 0, NodeKind.B: 1}
    # ranks ordered by (clock, rank); a rank waiting for a producer nobody has scheduled yet sleeps
    # until an F or B is scheduled on a neighbouring stage (the only nodes its candidates can need)
    awake = [(0.0, r) for r in range(pp)]
    asleep: set[int] = set()
    neighbours = [
        {placement.rank_of(s) for s in (stage - 1, stage + 1) if 0 <= s < placement.num_stages}
        for stage in range(placement.num_stages)
    ]
    while awake:
        t, rank = heapq.heappop(awake)
        cands = candidates(rank)
        now = [c for c in cands if c[3] is not None and c[3] <= t]
        if now:
            kind, chunk, mb, _ = min(now, key=lambda c: (kind_rank[c[0]], -placement.stage(rank, c[1])))
            run(rank, kind, chunk, mb, t)
            for r in asleep & neighbours[placement.stage(rank, chunk)]:
                asleep.discard(r)
                heapq.heappush(awake, (clock[r], r))
        elif w_queue[rank] and not (fixed and cands and _delays(cands, t + w_cost(rank))):
            mb, chunk = w_queue[rank].popleft()
            run(rank, NodeKind.W, chunk, mb, t)
        elif known := [c[3] for c in cands if c[3] is not None]:
            clock[rank] = min(known)
        else:
            asleep.add(rank)
            continue
        if remaining[rank]:
            heapq.heappush(awake, (clock[rank], rank))
    if any(remaining):
        raise ScheduleShapeError(
            f"{algorithm}: with {_limits(policy)} the pipeline stalls ({m} microbatches, pp={pp}); "
            "raise the memory limit"
        )
    return TimedRows(tuple(tuple(r) for r in rows), max(clock))


def _delays(cands: list[tuple[NodeKind, int, int, float | None]], w_end: float) -> bool:
    """True if a W ending at ``w_end`` would hold up a node known to be ready before then."""
    return any(ready is not None and ready < w_end - 1e-9 for *_, ready in cands)


def _limits(policy: FillPolicy | FixedOrder) -> str:
    if isinstance(policy, FixedOrder):
        return f"a fixed F/B order and at most {policy.pending_w} deferred W's per rank"
    return f"at most {policy.cap} chunk activations per rank"


def best_fill(
    placement: Placement,
    microbatches: int,
    costs: ComputeCosts | None,
    policies: list[FillPolicy | FixedOrder],
    *,
    p2p_time: float = 0.0,
    algorithm: str,
) -> ScheduleTable:
    """The table of the policy with the shortest makespan under ``costs`` (unit costs if None).

    Policies that stall are skipped; if all stall the last error is raised. Ties keep the earlier policy,
    so list the preferred (usually lower-memory) policy first.
    """
    costs = costs or unit_costs(placement.num_stages)
    best: TimedRows | None = None
    error: ScheduleShapeError | None = None
    for policy in policies:
        try:
            timed = list_schedule(placement, microbatches, costs, policy, p2p_time=p2p_time, algorithm=algorithm)
        except ScheduleShapeError as exc:
            error = exc
            continue
        if best is None or timed.makespan < best.makespan - 1e-9:
            best = timed
    if best is None:
        assert error is not None
        raise error
    return ScheduleTable.build(placement, microbatches, best.rows, algorithm)
