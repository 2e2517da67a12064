"""Building-block construction of V-shape schedules (after Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024).

A building block is where one microbatch's F and B nodes sit in time on every rank. Repeating it every
``period`` (the busiest rank's F+B+W time per microbatch) gives a schedule whose steady state has no
bubble if no two nodes of one rank overlap modulo the period; the activation memory of a rank is then
the number of its blocks alive at once, i.e. its lifespans (F start to W end, per chunk) divided by the
period. So the block decides memory, and how far its chain is stretched decides the start-up and
cool-down bubble.

The block here is laid out along the microbatch's dependency chain (down the V's forward, back up,
then the backward the same way), each node at the earliest time after its producer at which its rank
has that part of the period free (with F = B = W: a chain of 4p chunk nodes, each rank's two lifespans
adding up to about 4p, so about p/3 microbatches of memory, V-min's). Two knobs shape it: ``stretch``
makes each hop down the pipeline wait one more node length (V-half's block, about p/2 microbatches),
``turn`` waits before the first backward.

Two ways turn a block into a schedule, and both are kept as candidates:

* :func:`repeated_order`: repeat the block ``m`` times and sort each rank's F/B nodes by time; the list
  scheduler then runs that order as soon as possible and places the W's in the waits (see
  :class:`~primuspipe.algorithms.list_scheduler.FixedOrder`). Works with any costs.
* :func:`squeezed_orders`: on the unit time grid of uniform costs, place every W in the rank's first
  free slot after its B, then *squeeze*: visiting the slots in time order, move each node to the
  earliest free slot after its inputs where the rank's memory (counted until W) stays within the
  budget, and in the cool-down to the earliest free slot at all. The squeeze front-loads the warm-up
  (rank 0 runs forwards until its memory is full) and closes the cool-down's gaps, which the repeated
  order alone cannot do; the list scheduler then times the squeezed F/B order under the real costs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from primuspipe.algorithms.list_scheduler import FixedOrder
from primuspipe.ir.activations import peak_level
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.dataflow import Step, step_needs
from primuspipe.ir.kinds import split_kinds
from primuspipe.ir.node import NodeKind
from primuspipe.ir.placement import Placement

_EPS = 1e-9
_SPLIT = split_kinds()
"""A split backward's kinds (F, B, W), from the kind table."""

FBOrder = tuple[tuple[tuple[NodeKind, int], ...], ...]
"""Per rank, its F and B nodes in order, as ``(kind, chunk)`` (microbatches are implied)."""


def _earliest_free(t: float, duration: float, taken: list[tuple[float, float]], period: float) -> float | None:
    """Earliest time >= t at which [time, time + duration) overlaps none of ``taken`` modulo ``period``;
    None if no free gap of the period is that long (the search never skips a fitting start, so one
    not found within a period from ``t`` does not exist)."""
    give_up = t + period + _EPS
    moved = True
    while moved:
        if t > give_up:
            return None
        moved = False
        for start, length in taken:
            into = (t - start) % period  # how far t lies past the start of a taken slot
            into = 0.0 if into > period - _EPS else into
            if into < length - _EPS:  # t is inside the slot
                t += length - into
                moved = True
            elif period - into < duration - _EPS:  # the slot starts before [t, t + duration) ends
                t += period - into + length
                moved = True
    return t


@dataclass(frozen=True)
class Block:
    """Where one microbatch's F and B nodes start, and how often the block repeats."""

    starts: dict[tuple[NodeKind, int], float]
    """(kind, stage) -> start time of microbatch 0's node."""
    period: float


def vshape_block(placement: Placement, cost: CostModel, stretch: int = 0, turn: int = 0) -> Block | None:
    """The block laid out greedily along the chain (module doc), P2P time between ranks; a hop to the
    next rank down the pipeline first waits ``stretch`` lengths of the node it leaves, and the first
    backward ``turn`` lengths of the last forward. None if a node finds no gap of its rank's period
    long enough (uneven costs can fragment the free time)."""
    num_stages = placement.num_stages
    duration = {(kind, s): cost.duration(kind, s) for kind in _SPLIT for s in range(num_stages)}
    period = max(_EPS, *(
        sum(duration[(kind, placement.stage(r, c))] for kind in _SPLIT for c in range(placement.vpp))
        for r in range(placement.pp)
    ))
    chain = [(NodeKind.F, s) for s in range(num_stages)] + [(NodeKind.B, s) for s in reversed(range(num_stages))]
    taken: list[list[tuple[float, float]]] = [[] for _ in range(placement.pp)]
    starts: dict[tuple[NodeKind, int], float] = {}
    t, previous_rank, previous_length = 0.0, 0, 0.0
    for kind, stage in chain:
        rank = placement.rank_of(stage)
        if rank != previous_rank:
            t += cost.p2p.transfer_time(previous_rank, rank) + (stretch * previous_length if rank > previous_rank else 0.0)
        if kind is NodeKind.B and stage == num_stages - 1:
            t += turn * previous_length
        length = duration[(kind, stage)]
        t = _earliest_free(t, length, taken[rank], period)
        if t is None:
            return None
        taken[rank].append((t % period, length))
        starts[(kind, stage)] = t
        t, previous_rank, previous_length = t + length, rank, length
    return Block(starts, period)


def paper_block(placement: Placement, schedule: str) -> Block:
    """The repeating block the Controllable Memory paper draws for V-min and V-half, on the unit grid
    (F = B = W = 1; each rank's period of 6 holds microbatch 0's two F's, two B's and the two W's that
    fill its free slots). Where rank ``i`` of ``p`` starts microbatch 0's nodes::

                 F chunk 0    F chunk 1    B chunk 1         B chunk 0
        V-min    i            2p - 1 - i   2p + i + g        4p - 1 - i + g     g = 2 if p % 3 == 0 else 0
        V-half   2i           3p - 2 - i   3p - 1 + 2i + g   6p - 2 - i + g     g = 3 if p % 2 == 0 else 0

    V-min's forwards go down and up the V one slot apart and its backwards turn at once: each rank's two
    lifespans add up to about 4p slots, p/3 microbatches of memory. V-half spaces chunk 0's forwards
    and chunk 1's backwards two slots apart: about 6p slots, p/2 microbatches. The gap ``g`` moves the
    backwards off the forwards' slots where they would meet modulo 6. V-min's block is the chain layout
    :func:`vshape_block` finds on the unit grid (turning two slots late where p % 3 == 0), so it competes
    among the blocks; V-half's is timed beside the winner (:mod:`~primuspipe.algorithms.competition`)."""
    p = placement.pp
    assert placement.vpp == 2 and schedule in ("v-min", "v-half"), "the papers' blocks are V-shape blocks"
    starts: dict[tuple[NodeKind, int], float] = {}
    for i in range(p):
        if schedule == "v-min":
            g = 2 if p % 3 == 0 else 0
            times = (i, 2 * p - 1 - i, 2 * p + i + g, 4 * p - 1 - i + g)
        else:
            g = 3 if p % 2 == 0 else 0
            times = (2 * i, 3 * p - 2 - i, 3 * p - 1 + 2 * i + g, 6 * p - 2 - i + g)
        down, up = placement.stage(i, 0), placement.stage(i, 1)
        for key, t in zip(((NodeKind.F, down), (NodeKind.F, up), (NodeKind.B, up), (NodeKind.B, down)), times):
            starts[key] = float(t)
    return Block(starts, 6.0)


BLEND_WEIGHTS = (1.0, 0.5)
"""How much of the real costs' unevenness a block is laid out with (the uniform block, weight 0, is
squeezed on the unit grid instead). Uneven costs stretch the chain against the period and so the
block's memory; a blend keeps part of the adaptation within a budget the real-cost block would exceed."""

SHAPES = ((0, 0), (0, 2), (1, 0), (1, 2))
"""The ``(stretch, turn)`` of the uniform blocks squeezed on the unit grid: V-min's tight block and
V-half's stretched one, each turning at once or two nodes later (which leaves the W's of the turn
their slots; the paper's blocks use such gaps at some p)."""


def blended(cost: CostModel, weight: float) -> CostModel:
    """``cost`` with compute times moved toward their overall mean: weight 1 keeps them, 0 makes every
    node equal (P2P time is kept)."""
    values = [t for key in ("f", "b", "w") for t in cost.compute.times[key]]
    mean = sum(values) / len(values)

    def blend(_key: str, times: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(weight * t + (1 - weight) * mean for t in times)

    return replace(cost, compute=cost.compute.map(blend), fused_backward=None)


def block_orders(placement: Placement, microbatches: int, cost: CostModel, memory: float) -> list[FixedOrder]:
    """The distinct block orders that fit ``memory`` chunk activations (counted until W with the cost
    model's retained share): the uniform blocks of :data:`SHAPES` squeezed, then the real-cost blocks
    (blended toward uniform ones) repeated, each run with and without the fill's lookahead."""
    unit = CostModel.per_stage(placement.num_stages, 1.0, 1.0, 1.0, memory=cost.memory)
    retained = cost.memory.w_retained_fraction
    sequences: dict[FBOrder, str] = {}
    for stretch, turn in SHAPES:
        block = vshape_block(placement, unit, stretch, turn)
        if block is not None and (orders := squeezed_orders(placement, microbatches, block, retained, memory)):
            for cooldown, seq in zip((False, True), orders):
                sequences.setdefault(seq, f"block stretch={stretch} turn={turn}, squeezed"
                                          f"{' with its cool-down' if cooldown else ''}")
    for weight in BLEND_WEIGHTS:
        if (block := vshape_block(placement, blended(cost, weight))) is not None:
            sequences.setdefault(repeated_order(placement, microbatches, block), f"block of the costs blended {weight:g}")
    return [FixedOrder(seq, memory, lookahead, source) for seq, source in sequences.items()
            if peak_chunk_activations(seq) <= memory + _EPS for lookahead in (False, True)]


def repeated_order(placement: Placement, microbatches: int, block: Block) -> FBOrder:
    """Each rank's F/B order when the block repeats once per microbatch."""
    events: list[list[tuple[float, int, NodeKind, int]]] = [[] for _ in range(placement.pp)]
    for (kind, stage), start in block.starts.items():
        rank, chunk = placement.locate(stage)
        for mb in range(microbatches):
            events[rank].append((start + mb * block.period, mb, kind, chunk))
    return tuple(tuple((kind, chunk) for _, _, kind, chunk in sorted(e, key=lambda x: x[:2])) for e in events)


def squeezed_orders(placement: Placement, microbatches: int, block: Block, retained: float, memory: float
                    ) -> tuple[FBOrder, FBOrder] | None:
    """Each rank's F/B order after repeating a unit-grid block, placing the W's and squeezing (module
    doc): as squeezed, and with the cool-down's gaps closed too (that second squeeze continues the first
    on the same grid, so one grid gives both). None if the block's layout holds more than ``memory``
    chunk activations (counted until W) on some rank."""
    grid = _Grid(placement, microbatches, block, retained)
    if grid.peak > memory + _EPS:
        return None
    last_forward = [grid.slot[Step(NodeKind.F, placement.stage(r, placement.vpp - 1), microbatches - 1)]
                    for r in range(placement.pp)]
    in_cooldown = {step for r in range(placement.pp) for t, step in grid.rows[r].items() if t > last_forward[r]}
    grid.squeeze(lambda rank, step: memory)
    squeezed = grid.order()
    grid.drop_w(in_cooldown)
    grid.squeeze(lambda rank, step: math.inf if step in in_cooldown else None)
    return squeezed, grid.order()


class _Grid:
    """A repeated block on the unit time grid (one node per slot): who runs in which slot, and what each
    rank holds after each slot."""

    def __init__(self, placement: Placement, microbatches: int, block: Block, retained: float):
        self.placement = placement
        self._needs: dict[tuple[NodeKind, int], list[tuple[NodeKind, int]]] = {}
        self.delta = {kind: kind.spec.activation_delta(retained) for kind in _SPLIT}
        self.rows: list[dict[int, Step]] = [{} for _ in range(placement.pp)]
        self.slot: dict[Step, int] = {}
        period = round(block.period)
        for (kind, stage), start in block.starts.items():
            rank = placement.rank_of(stage)
            for mb in range(microbatches):
                self._put(rank, Step(kind, stage, mb), round(start) + mb * period)
        # each W in the first free slot after its B (first come, first served)
        self.levels: list[list[float]] = []
        for rank, row in enumerate(self.rows):
            waiting: deque[Step] = deque()
            held, levels, t = 0.0, [], 0
            end = max(row) + 1
            while t < end or waiting:
                step = row.get(t)
                if step is None and waiting:
                    step = waiting.popleft()
                    self._put(rank, step, t)
                if step is not None:
                    held += self.delta[step.kind]
                    if step.kind is NodeKind.B:
                        waiting.append(Step(NodeKind.W, step.stage, step.microbatch))
                levels.append(held)
                t += 1
            self.levels.append(levels)
        self.horizon = max(map(len, self.levels))
        for levels in self.levels:
            levels.extend([levels[-1]] * (self.horizon - len(levels)))
        self.peak = max(max(levels) for levels in self.levels)

    def _put(self, rank: int, step: Step, t: int) -> None:
        assert t not in self.rows[rank], "a block's nodes overlap on the grid"
        self.rows[rank][t] = step
        self.slot[step] = t

    def earliest(self, step: Step) -> int:
        """The first slot after the step's inputs and its predecessor of the same kind and stage."""
        kind, stage, mb = step
        if (needs := self._needs.get((kind, stage))) is None:
            needs = self._needs[(kind, stage)] = [(n.kind, n.stage) for n in step_needs(self.placement, kind, stage, 0)] \
                if kind is not NodeKind.W else [(NodeKind.B, stage)]
        slot = self.slot
        first = max((slot[Step(k, s, mb)] + 1 for k, s in needs), default=0)
        return max(first, slot[Step(kind, stage, mb - 1)] + 1) if mb else first

    def order(self) -> FBOrder:
        """Each rank's F/B nodes in slot order (the W's are the fill's to place)."""
        return tuple(tuple((step.kind, self.placement.locate(step.stage)[1]) for _, step in sorted(row.items())
                           if step.kind is not NodeKind.W) for row in self.rows)

    def drop_w(self, steps: set[Step]) -> None:
        for step in steps:
            if step.kind is NodeKind.W:
                del self.rows[self.placement.rank_of(step.stage)][self.slot.pop(step)]

    def squeeze(self, limit) -> None:
        """Visit the slots in time order (all ranks); move each node to the earliest free slot after its
        inputs such that the rank's memory stays within ``limit(rank, step)`` (None: leave it) until
        the slot it leaves."""
        for t in range(self.horizon):
            for rank, row in enumerate(self.rows):
                step = row.get(t)
                if step is None or (cap := limit(rank, step)) is None:
                    continue
                delta, levels, first, bound = self.delta[step.kind], self.levels[rank], self.earliest(step), cap + _EPS
                target, j = None, t - 1
                while j >= first and levels[j] + delta <= bound:  # the slots it may move over
                    if j not in row:
                        target = j
                    j -= 1
                if target is not None:
                    levels[target:t] = [level + delta for level in levels[target:t]]
                    del row[t]
                    self._put(rank, step, target)


def peak_chunk_activations(sequence: FBOrder) -> float:
    """Most chunk activations any rank holds under the F/B orders alone, each from its F until its B
    (a lower bound on what any placement of the W's holds, counted until W)."""
    return max((peak_level(row, retained=0.0) for row in sequence), default=0.0)
