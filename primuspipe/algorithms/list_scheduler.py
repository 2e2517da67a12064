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

Two fills share one event loop (:func:`_fill`) and differ only in their candidates:

* :func:`greedy_fill` (a :class:`FillPolicy`): the next F and B of every chunk that the caps allow;
* :func:`fixed_order_fill` (a :class:`FixedOrder`): each rank's next F or B of a constructed order
  (e.g. a repeated building block), so the order fixes the activation memory and the fill squeezes
  the constructed timing to as-soon-as-possible and moves W's into the waits.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

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


class Candidate(NamedTuple):
    """A node a free rank could run next, and when its inputs are there (None: a producer is not
    scheduled yet)."""

    kind: NodeKind
    chunk: int
    microbatch: int
    ready: float | None


class _Pipeline:
    """The state both fills share: what ran where and when, per rank."""

    def __init__(self, placement: Placement, microbatches: int, costs: ComputeCosts, p2p_time: float):
        pp, vpp = placement.pp, placement.vpp
        self.placement, self.m = placement, microbatches
        self.finish: dict[tuple[NodeKind, int, int], float] = {}  # (step kind, stage, mb) -> end time
        self.clock = [0.0] * pp
        self.held = [0.0] * pp  # chunk activations held (the one counter's F -> B rule)
        self.next_f = [[0] * vpp for _ in range(pp)]
        self.next_b = [[0] * vpp for _ in range(pp)]
        self.w_queue: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
        self.rows: list[list[ScheduleNode]] = [[] for _ in range(pp)]
        self.remaining = [len(_SCHEDULED) * microbatches * vpp] * pp
        self.durations = {kind: costs.of(kind) for kind in _SCHEDULED}
        # (kind, stage) -> [(needed step kind, needed stage, delay)]: dataflow's rules, resolved once
        self.needs = {
            (kind, placement.stage(r, c)): [
                (need.kind, need.stage, p2p_time if placement.rank_of(need.stage) != r else 0.0)
                for need in step_needs(placement, kind, placement.stage(r, c), 0)
            ]
            for kind in _SCHEDULED for r in range(pp) for c in range(vpp)
        }

    def candidate(self, rank: int, kind: NodeKind, chunk: int) -> Candidate:
        """The next ``kind`` node of ``chunk`` on ``rank``, with the time its inputs are there."""
        mb = (self.next_f if kind is NodeKind.F else self.next_b)[rank][chunk]
        t: float | None = 0.0
        for need_kind, need_stage, delay in self.needs[(kind, self.placement.stage(rank, chunk))]:
            done = self.finish.get((need_kind, need_stage, mb))
            if done is None:
                t = None
                break
            t = max(t, done + delay)
        return Candidate(kind, chunk, mb, t)

    def run(self, rank: int, kind: NodeKind, chunk: int, mb: int, start: float) -> None:
        stage = self.placement.stage(rank, chunk)
        end = start + self.durations[kind][stage]
        self.finish[(kind, stage, mb)] = end
        self.clock[rank] = end
        self.remaining[rank] -= 1
        self.rows[rank].append(ScheduleNode(kind, mb, chunk))
        self.held[rank] += kind.spec.activation_delta()
        if kind is NodeKind.F:
            self.next_f[rank][chunk] += 1
        elif kind is NodeKind.B:
            self.next_b[rank][chunk] += 1
            self.w_queue[rank].append((mb, chunk))

    def run_deferred_w(self, rank: int, start: float) -> None:
        mb, chunk = self.w_queue[rank].popleft()
        self.run(rank, NodeKind.W, chunk, mb, start)

    def next_w_time(self, rank: int) -> float:
        return self.durations[NodeKind.W][self.placement.stage(rank, self.w_queue[rank][0][1])]


def greedy_fill(placement: Placement, microbatches: int, costs: ComputeCosts, policy: FillPolicy, *,
                p2p_time: float = 0.0, algorithm: str = "list-schedule") -> TimedRows:
    """The zero-bubble papers' heuristic (module doc): a free rank runs the best ready F or B the caps
    allow, else a deferred W. Raises ScheduleShapeError if the caps stall it."""
    pp, vpp = placement.pp, placement.vpp
    assert len(policy.cap) == pp
    for r, cap in enumerate(policy.cap):
        if cap < 1 + policy.reserve:
            raise ScheduleShapeError(
                f"{algorithm}: rank {r} may hold {cap} chunk activations, but needs at least "
                f"{1 + policy.reserve} to make progress; raise the memory limit"
            )
    state = _Pipeline(placement, microbatches, costs, p2p_time)
    forward_room = NodeKind.F.spec.activation_delta()

    def candidates(rank: int) -> list[Candidate]:
        """The next B and F of each chunk that the memory cap and the W limit allow."""
        out = []
        for c in range(vpp):
            if state.next_b[rank][c] < state.next_f[rank][c]:
                out.append(state.candidate(rank, NodeKind.B, c))
            room = policy.cap[rank] - (0 if c == vpp - 1 else policy.reserve)
            if (state.next_f[rank][c] < microbatches and state.held[rank] + forward_room <= room
                    and len(state.w_queue[rank]) < policy.w_limit(rank)):
                out.append(state.candidate(rank, NodeKind.F, c))
        return out

    first = (NodeKind.B, NodeKind.F) if policy.backward_first else (NodeKind.F, NodeKind.B)
    return _fill(state, candidates, lambda rank, cands, t: True, first, policy, algorithm)


def fixed_order_fill(placement: Placement, microbatches: int, costs: ComputeCosts, order: FixedOrder, *,
                     p2p_time: float = 0.0, algorithm: str = "list-schedule") -> TimedRows:
    """Each rank runs its F/B nodes in ``order`` as soon as possible; a deferred W fills a wait only
    where it holds up nothing known to be ready before it would end."""
    assert len(order.sequence) == placement.pp
    state = _Pipeline(placement, microbatches, costs, p2p_time)

    def candidates(rank: int) -> list[Candidate]:
        """The rank's next node of the order, unless a deferred W must run first."""
        done = sum(state.next_f[rank]) + sum(state.next_b[rank])
        if done == len(order.sequence[rank]):
            return []
        kind, chunk = order.sequence[rank][done]
        if kind is NodeKind.F and len(state.w_queue[rank]) >= order.w_limit(rank):
            return []
        return [state.candidate(rank, kind, chunk)]

    def w_may_run(rank: int, cands: list[Candidate], t: float) -> bool:
        w_end = t + state.next_w_time(rank)
        return not any(c.ready is not None and c.ready < w_end - 1e-9 for c in cands)

    return _fill(state, candidates, w_may_run, (NodeKind.B, NodeKind.F), order, algorithm)


def _fill(state: _Pipeline, candidates, w_may_run, preference: tuple[NodeKind, NodeKind],
          policy: FillPolicy | FixedOrder, algorithm: str) -> TimedRows:
    """The event loop both fills share: ranks in (clock, rank) order; a rank runs a ready candidate
    (``preference`` breaks kind ties, then the later stage), else a deferred W where ``w_may_run``,
    else waits for its earliest known candidate or sleeps until a neighbour schedules something."""
    placement = state.placement
    rank_of_kind = {kind: i for i, kind in enumerate(preference)}
    awake = [(0.0, r) for r in range(placement.pp)]
    asleep: set[int] = set()
    neighbours = [
        {placement.rank_of(s) for s in (stage - 1, stage + 1) if 0 <= s < placement.num_stages}
        for stage in range(placement.num_stages)
    ]
    while awake:
        t, rank = heapq.heappop(awake)
        cands = candidates(rank)
        now = [c for c in cands if c.ready is not None and c.ready <= t]
        if now:
            best = min(now, key=lambda c: (rank_of_kind[c.kind], -placement.stage(rank, c.chunk)))
            state.run(rank, best.kind, best.chunk, best.microbatch, t)
            for r in asleep & neighbours[placement.stage(rank, best.chunk)]:
                asleep.discard(r)
                heapq.heappush(awake, (state.clock[r], r))
        elif state.w_queue[rank] and (not cands or w_may_run(rank, cands, t)):
            state.run_deferred_w(rank, t)
        elif known := [c.ready for c in cands if c.ready is not None]:
            state.clock[rank] = min(known)
        else:
            asleep.add(rank)
            continue
        if state.remaining[rank]:
            heapq.heappush(awake, (state.clock[rank], rank))
    if any(state.remaining):
        raise ScheduleShapeError(
            f"{algorithm}: with {_limits(policy)} the pipeline stalls ({state.m} microbatches, pp={placement.pp}); "
            "raise the memory limit"
        )
    return TimedRows(tuple(tuple(r) for r in state.rows), max(state.clock))


def list_schedule(placement: Placement, microbatches: int, costs: ComputeCosts, policy: FillPolicy | FixedOrder, *,
                  p2p_time: float = 0.0, algorithm: str = "list-schedule") -> TimedRows:
    """:func:`greedy_fill` for a :class:`FillPolicy`, :func:`fixed_order_fill` for a :class:`FixedOrder`."""
    fill = greedy_fill if isinstance(policy, FillPolicy) else fixed_order_fill
    return fill(placement, microbatches, costs, policy, p2p_time=p2p_time, algorithm=algorithm)


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
