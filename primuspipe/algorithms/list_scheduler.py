"""Greedy list scheduling of split-backward (F / B / W) nodes under a per-rank memory budget.

The zero-bubble papers build their schedules the same way once the memory budget is fixed: every rank
runs, whenever it is free, the most useful node that can start now — a backward (frees memory and feeds
the backward wave) or a forward (feeds the forward wave) — and spends any wait on a deferred weight-grad
W, whose only dependant is the optimizer. The budget alone shapes the phases:

* warm-up: forwards until the rank holds its cap of activations (so the cap *is* the warm-up count);
* steady: a backward frees a slot, a forward takes it, and W's fill the gaps between arrivals;
* cool-down: the remaining backwards, with the deferred W's filling the waits and draining at the end.

Memory is counted as the device holds it (:mod:`primuspipe.ir.activations`): a microbatch from its F
until its W, at the cost model's retained share between its B and its W. A deferred W therefore holds
memory, and a forward that would exceed the budget waits for W's to run first: the budget bounds the
warm-up and the W's held back together, whatever the number of microbatches.

Decisions are taken against the request's cost model (per-stage times, P2P time between ranks), so
non-uniform F/B/W costs move the W's into the gaps they actually fit. The result is a feasible timed
execution of the order it returns; callers compare candidates by simulating them
(:mod:`~primuspipe.algorithms.competition`).

Forwards and backwards of one chunk run in microbatch order (microbatches are interchangeable, so an
exchange argument shows this loses nothing); W's run in the order their B's finished.

Two fills share one event loop (:func:`_fill`) and differ only in their candidates:

* :func:`greedy_fill` (a :class:`FillPolicy`): the next F and B of every chunk that the caps allow;
* :func:`fixed_order_fill` (a :class:`FixedOrder`): each rank's next F or B of a constructed order
  (e.g. a repeated building block), so the order fixes when activations are taken and the fill
  squeezes the constructed timing to as-soon-as-possible and moves W's into the waits.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.dataflow import step_needs
from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.kinds import split_kinds
from primuspipe.ir.node import NodeKind, ScheduleNode, shared_node
from primuspipe.ir.placement import Placement

_SCHEDULED = split_kinds()
"""The kinds this scheduler places: a split backward, one node per step (F, B, W), from the kind table."""

_EPS = 1e-9


@dataclass(frozen=True)
class FillPolicy:
    """How a free rank picks its next node.

    ``memory[r]`` is rank ``r``'s budget: the chunk activations it may hold, counted until W (the
    module docstring). ``in_flight[r]`` bounds the forwards whose B has not run yet, which is the
    warm-up length (ZB-H1 warms rank r up with p - r forwards inside 1F1B's memory of p). ``reserve``
    slots of both stay free for forwards of the rank's last chunk: a V-shape rank that filled its
    memory with chunk-0 forwards could never run the chunk-1 forward that starts the backward wave.
    ``backward_first`` breaks a tie between a ready B and a ready F.
    """

    in_flight: tuple[int, ...]
    memory: tuple[float, ...]
    reserve: int = 0
    backward_first: bool = True

    def __str__(self) -> str:
        caps = f"{self.in_flight[0]}" if len(set(self.in_flight)) == 1 else "-".join(map(str, self.in_flight))
        memory = "unlimited" if math.isinf(max(self.memory)) else f"{max(self.memory):g}"
        return (f"greedy fill, in flight {caps}, memory {memory}, reserve {self.reserve}, "
                f"{'B' if self.backward_first else 'F'} first")


@dataclass(frozen=True)
class FixedOrder:
    """Every rank runs its F's and B's in a given order; only the W's are placed by the fill.

    ``sequence[r]`` lists rank ``r``'s F and B nodes as (kind, chunk); the microbatch of each is implied
    (one chunk's forwards and backwards run in microbatch order). ``memory`` is each rank's budget in
    chunk activations counted until W: a forward that would exceed it waits for deferred W's to run.
    """

    sequence: tuple[tuple[tuple[NodeKind, int], ...], ...]
    memory: float
    lookahead: bool = False
    """Whether a rank whose next node is not ready may run a later one of the order that is."""
    source: str = "a fixed order"
    """Where the order comes from, for people (e.g. a building block's shape)."""

    def __str__(self) -> str:
        return f"{self.source}{', lookahead' if self.lookahead else ''}"


@dataclass(frozen=True)
class TimedRows:
    """The per-rank node order the scheduler chose and the makespan its own timing gives."""

    rows: tuple[tuple[ScheduleNode, ...], ...]
    makespan: float


class Candidate(NamedTuple):
    """A node a free rank could run next, and when its inputs are there (None: a producer is not
    scheduled yet); of the ready ones the rank runs the one of least ``priority``."""

    kind: NodeKind
    chunk: int
    microbatch: int
    ready: float | None
    priority: tuple = ()


class _Pipeline:
    """The state both fills share: what ran where and when, and what each rank holds."""

    def __init__(self, placement: Placement, microbatches: int, cost: CostModel):
        pp, vpp = placement.pp, placement.vpp
        self.placement, self.m = placement, microbatches
        # (step kind, stage) -> per microbatch, the end time of its node (None: not scheduled yet)
        self.finish: dict[tuple[NodeKind, int], list[float | None]] = {
            (kind, s): [None] * microbatches for kind in _SCHEDULED for s in range(placement.num_stages)}
        self.clock = [0.0] * pp
        self.in_flight = [0] * pp  # forwards whose B has not run
        self.held = [0.0] * pp  # chunk activations held, counted until W (the one counter's rule)
        self.delta = {kind: kind.spec.activation_delta(cost.memory.w_retained_fraction) for kind in _SCHEDULED}
        self.next_f = [[0] * vpp for _ in range(pp)]
        self.next_b = [[0] * vpp for _ in range(pp)]
        self.w_queue: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
        self.rows: list[list[ScheduleNode]] = [[] for _ in range(pp)]
        self.remaining = [len(_SCHEDULED) * microbatches * vpp] * pp
        self.durations = {kind: [cost.duration(kind, s) for s in range(placement.num_stages)] for kind in _SCHEDULED}
        # (kind, rank, chunk) -> ((end times of the needed step, delay), ...): dataflow's rules, resolved once
        self.needs = {
            (kind, r, c): tuple(
                (self.finish[need.kind, need.stage], 0.0 if (src := placement.rank_of(need.stage)) == r
                 else cost.p2p.transfer_time(src, r))
                for need in step_needs(placement, kind, placement.stage(r, c), 0)
            )
            for kind in _SCHEDULED for r in range(pp) for c in range(vpp)
        }

    def fits_forward(self, rank: int, limit: float) -> bool:
        """Whether one more forward keeps the rank's memory (counted until W) within ``limit``."""
        return self.held[rank] + self.delta[NodeKind.F] <= limit + _EPS

    def candidate(self, rank: int, kind: NodeKind, chunk: int, priority: tuple) -> Candidate:
        """The next ``kind`` node of ``chunk`` on ``rank``, with the time its inputs are there."""
        mb = (self.next_f if kind is NodeKind.F else self.next_b)[rank][chunk]
        t = 0.0
        for ends, delay in self.needs[kind, rank, chunk]:
            done = ends[mb]
            if done is None:
                return Candidate(kind, chunk, mb, None, priority)
            if done + delay > t:
                t = done + delay
        return Candidate(kind, chunk, mb, t, priority)

    def run(self, rank: int, kind: NodeKind, chunk: int, mb: int, start: float) -> None:
        stage = self.placement.stages[rank][chunk]
        end = start + self.durations[kind][stage]
        self.finish[kind, stage][mb] = end
        self.clock[rank] = end
        self.remaining[rank] -= 1
        self.rows[rank].append(shared_node(kind, mb, chunk))
        self.held[rank] += self.delta[kind]
        if kind is NodeKind.F:
            self.next_f[rank][chunk] += 1
            self.in_flight[rank] += 1
        elif kind is NodeKind.B:
            self.next_b[rank][chunk] += 1
            self.in_flight[rank] -= 1
            self.w_queue[rank].append((mb, chunk))

    def run_deferred_w(self, rank: int, start: float) -> None:
        mb, chunk = self.w_queue[rank].popleft()
        self.run(rank, NodeKind.W, chunk, mb, start)

    def next_w_time(self, rank: int) -> float:
        return self.durations[NodeKind.W][self.placement.stage(rank, self.w_queue[rank][0][1])]


def greedy_fill(placement: Placement, microbatches: int, cost: CostModel, policy: FillPolicy, *,
                algorithm: str = "list-schedule") -> TimedRows:
    """The zero-bubble papers' heuristic (module doc): a free rank runs the best ready F or B the caps
    allow, else a deferred W. Raises ScheduleShapeError if the caps stall it."""
    pp, vpp = placement.pp, placement.vpp
    assert len(policy.in_flight) == len(policy.memory) == pp
    for r, cap in enumerate(policy.memory):
        if min(cap, policy.in_flight[r]) < 1 + policy.reserve:
            raise ScheduleShapeError(
                f"{algorithm}: rank {r} may hold {cap:g} chunk activations, but needs at least "
                f"{1 + policy.reserve} to make progress; raise the memory limit"
            )
    state = _Pipeline(placement, microbatches, cost)

    first = (NodeKind.B, NodeKind.F) if policy.backward_first else (NodeKind.F, NodeKind.B)
    # per rank, its chunks' B's and F's with their priority (the kind ``first`` prefers, then the later
    # stage), most preferred first
    preferred = [sorted(((first.index(kind), -placement.stage(r, c)), kind, c) for kind in first for c in range(vpp))
                 for r in range(pp)]

    def candidates(rank: int, t: float) -> list[Candidate]:
        """The next B and F of each chunk that the caps allow, most preferred first, up to the first
        ready at ``t`` (preferred to every later one)."""
        out = []
        next_f, next_b = state.next_f[rank], state.next_b[rank]
        for priority, kind, c in preferred[rank]:
            if kind is NodeKind.B:
                if next_b[c] >= next_f[c]:
                    continue
            else:
                reserve = 0 if c == vpp - 1 else policy.reserve
                if not (next_f[c] < microbatches and state.in_flight[rank] + 1 <= policy.in_flight[rank] - reserve
                        and state.fits_forward(rank, policy.memory[rank] - reserve)):
                    continue
            out.append(found := state.candidate(rank, kind, c, priority))
            if found.ready is not None and found.ready <= t:
                break
        return out

    return _fill(state, candidates, lambda rank, cands, t: True, policy, algorithm)


def fixed_order_fill(placement: Placement, microbatches: int, cost: CostModel, order: FixedOrder, *,
                     algorithm: str = "list-schedule") -> TimedRows:
    """Each rank runs its F/B nodes in ``order`` as soon as possible; a deferred W fills a wait only
    where it holds up nothing known to be ready before it would end, and runs before a forward that
    would otherwise exceed the memory budget. With ``order.lookahead`` a rank whose next node is not
    ready runs the earliest later node of the order that is (and fits), as a squeeze of the
    constructed timing would move it into the wait."""
    assert len(order.sequence) == placement.pp
    state = _Pipeline(placement, microbatches, cost)
    # per rank, for each (kind, chunk) of its order: the positions of its nodes (consumed in microbatch order)
    # and the rank's counter of that kind's nodes run per chunk
    positions: list[list[tuple[NodeKind, int, list[int], list[int]]]] = []
    for rank, row in enumerate(order.sequence):
        where: dict[tuple[NodeKind, int], list[int]] = {}
        for i, key in enumerate(row):
            where.setdefault(key, []).append(i)
        positions.append([(kind, chunk, at, (state.next_f if kind is NodeKind.F else state.next_b)[rank])
                          for (kind, chunk), at in where.items()])
    # per rank and position of its order, the forwards before it (a prefix count, so a skip count is one lookup)
    forwards_before = [list(itertools.accumulate((kind is NodeKind.F for kind, _ in row), initial=0))
                       for row in order.sequence]

    def candidates(rank: int, t: float) -> list[Candidate]:
        """The rank's next node of the order (with lookahead, the next of every (kind, chunk) in order
        up to the first ready at ``t``, which the order prefers to every later one), unless deferred W's
        must run first to make room for a forward."""
        if order.lookahead:
            ahead = [(where[done], kind, chunk) for kind, chunk, where, run in positions[rank]
                     if (done := run[chunk]) < len(where)]
            ahead.sort()
        else:  # the nodes run as the order lists them: the next is the one after those run
            i, row = sum(state.next_f[rank]) + sum(state.next_b[rank]), order.sequence[rank]
            ahead = [(i, *row[i])] if i < len(row) else []
        out = []
        for i, kind, chunk in ahead:
            if kind is not NodeKind.F or state.fits_forward(rank, order.memory - skipped_forwards(rank, i)):
                out.append(found := state.candidate(rank, kind, chunk, (i,)))
                if found.ready is not None and found.ready <= t:
                    break
        return out

    def skipped_forwards(rank: int, position: int) -> int:
        """Forwards of the order before ``position`` not run yet: room a node run ahead of them keeps
        (every forward the rank ran is one of its order's)."""
        return forwards_before[rank][position] - sum(state.next_f[rank])

    def w_may_run(rank: int, cands: list[Candidate], t: float) -> bool:
        w_end = t + state.next_w_time(rank)
        return not any(c.ready is not None and c.ready < w_end - _EPS for c in cands)

    return _fill(state, candidates, w_may_run, order, algorithm)


def _fill(state: _Pipeline, candidates, w_may_run, policy: FillPolicy | FixedOrder, algorithm: str) -> TimedRows:
    """The event loop both fills share: ranks in (clock, rank) order; a rank runs its ready candidate
    of least priority (``candidates(rank, t)`` gives them, and may leave out any that one ready at ``t``
    precedes), else a deferred W where ``w_may_run``, else waits for its earliest known
    candidate or sleeps until a neighbour schedules something."""
    placement = state.placement
    awake = [(0.0, r) for r in range(placement.pp)]
    asleep: set[int] = set()
    neighbours = [
        {placement.rank_of(s) for s in (stage - 1, stage + 1) if 0 <= s < placement.num_stages}
        for stage in range(placement.num_stages)
    ]
    while awake:
        t, rank = heapq.heappop(awake)
        cands = candidates(rank, t)
        best = None  # the ready candidate of least priority, the first of equals
        for c in cands:
            if c.ready is not None and c.ready <= t and (best is None or c.priority < best.priority):
                best = c
        if best is not None:
            state.run(rank, best.kind, best.chunk, best.microbatch, t)
            for r in asleep & neighbours[placement.stage(rank, best.chunk)] if asleep else ():
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


def list_schedule(placement: Placement, microbatches: int, cost: CostModel, policy: FillPolicy | FixedOrder, *,
                  algorithm: str = "list-schedule") -> TimedRows:
    """:func:`greedy_fill` for a :class:`FillPolicy`, :func:`fixed_order_fill` for a :class:`FixedOrder`."""
    fill = greedy_fill if isinstance(policy, FillPolicy) else fixed_order_fill
    return fill(placement, microbatches, cost, policy, algorithm=algorithm)


def _limits(policy: FillPolicy | FixedOrder) -> str:
    if isinstance(policy, FixedOrder):
        return f"a fixed F/B order and at most {policy.memory:g} chunk activations per rank (counted until W)"
    return f"at most {policy.memory} chunk activations per rank (counted until W)"
