"""Building-block construction of V-shape schedules (after Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024).

A building block is where one microbatch's F and B nodes sit in time on every rank. Repeating it every
``period`` (the busiest rank's F+B+W time per microbatch) gives a schedule whose steady state has no
bubble if no two nodes of one rank overlap modulo the period; the activation memory of a rank is then
the number of its blocks alive at once, i.e. its lifespans (F start to B end, per chunk) divided by the
period. So the block decides memory, and how far its chain is stretched decides the start-up and
cool-down bubble.

The block here is laid out along the microbatch's dependency chain (down the V's forward, back up,
then the backward the same way), each node at the earliest time after its producer at which its rank
has that part of the period free (with F = B = W: a chain of 4p chunk nodes, each rank's two lifespans
adding up to about 4p, so about p/3 microbatches of memory, V-min's). Repeating the block ``m``
times and sorting each rank's nodes by time gives the F/B order; the list scheduler then runs that
order as soon as possible (squeezing out the redundant gaps of the repetition) and places the W's in
the waits (see :class:`~primuspipe.algorithms.list_scheduler.FixedOrder`).
"""

from __future__ import annotations

from dataclasses import dataclass

from primuspipe.algorithms.list_scheduler import FixedOrder
from primuspipe.ir.activations import peak_level
from primuspipe.ir.costs import ComputeCosts
from primuspipe.ir.node import NodeKind
from primuspipe.ir.placement import Placement

_EPS = 1e-9


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


def vshape_block(placement: Placement, costs: ComputeCosts, p2p_time: float = 0.0) -> Block | None:
    """The tightest block: the chain laid out greedily (module doc), P2P time between ranks; None if a
    node finds no gap of its rank's period long enough (uneven costs can fragment the free time)."""
    num_stages = placement.num_stages
    period = max(_EPS, *(
        sum(costs.forward[s] + costs.backward_input[s] + costs.backward_weight[s]
            for s in (placement.stage(r, c) for c in range(placement.vpp)))
        for r in range(placement.pp)
    ))
    chain = [(NodeKind.F, s) for s in range(num_stages)] + [(NodeKind.B, s) for s in reversed(range(num_stages))]
    taken: list[list[tuple[float, float]]] = [[] for _ in range(placement.pp)]
    starts: dict[tuple[NodeKind, int], float] = {}
    t, previous_rank = 0.0, 0
    for kind, stage in chain:
        rank = placement.rank_of(stage)
        duration = costs.forward[stage] if kind is NodeKind.F else costs.backward_input[stage]
        t = _earliest_free(t + (p2p_time if rank != previous_rank else 0.0), duration, taken[rank], period)
        if t is None:
            return None
        taken[rank].append((t % period, duration))
        starts[(kind, stage)] = t
        t, previous_rank = t + duration, rank
    return Block(starts, period)


BLEND_WEIGHTS = (1.0, 0.5, 0.25, 0.125, 0.0)
"""How much of the real costs' unevenness a block is laid out with (0: the paper's uniform block).
Uneven costs stretch the chain against the period and so the block's memory; a blend keeps part of
the adaptation within a budget the real-cost block would exceed."""


def blended(costs: ComputeCosts, weight: float) -> ComputeCosts:
    """``costs`` moved toward their overall mean: weight 1 keeps them, 0 makes every node equal."""
    values = costs.forward + costs.backward_input + costs.backward_weight
    mean = sum(values) / len(values)

    def blend(times: tuple[float, ...]) -> list[float]:
        return [weight * t + (1 - weight) * mean for t in times]

    return ComputeCosts.per_stage(costs.num_stages, blend(costs.forward), blend(costs.backward_input),
                                  blend(costs.backward_weight))


def block_orders(placement: Placement, microbatches: int, costs: ComputeCosts, p2p_time: float,
                 max_chunk_activations: int, max_deferred_w: int) -> list[FixedOrder]:
    """The distinct repeated-block orders, from the real costs to uniform ones, that fit the budget
    (each deferring at most ``max_deferred_w`` W's per rank)."""
    blocks = (vshape_block(placement, blended(costs, weight), p2p_time) for weight in BLEND_WEIGHTS)
    orders = dict.fromkeys(repeated_order(placement, microbatches, b, max_deferred_w) for b in blocks if b is not None)
    return [o for o in orders if peak_chunk_activations(o) <= max_chunk_activations]


def repeated_order(placement: Placement, microbatches: int, block: Block, pending_w: int) -> FixedOrder:
    """Each rank's F/B order when the block repeats once per microbatch (deferring at most ``pending_w``
    W's per rank when it runs)."""
    events: list[list[tuple[float, int, NodeKind, int]]] = [[] for _ in range(placement.pp)]
    for (kind, stage), start in block.starts.items():
        rank, chunk = placement.locate(stage)
        for mb in range(microbatches):
            events[rank].append((start + mb * block.period, mb, kind, chunk))
    return FixedOrder(tuple(tuple((kind, chunk) for _, _, kind, chunk in sorted(e, key=lambda x: x[:2])) for e in events),
                      pending_w)


def peak_chunk_activations(order: FixedOrder) -> float:
    """Most chunk activations any rank holds under the given F/B orders (the one activation counter)."""
    return max((peak_level(row) for row in order.sequence), default=0.0)
