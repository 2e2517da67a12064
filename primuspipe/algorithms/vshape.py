"""The V-shape family: ZBV (Qi et al., "Zero Bubble Pipeline Parallelism") and V-half / V-min (Qi et
al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

Each rank holds two chunks placed in a V (chunk 0 = stage r, chunk 1 = stage 2p-1-r), so rank 0 holds
the first and the last stage and the backward wave starts on the rank that started the forward wave.
A schedule's peak activation memory is its injection rate times the activations' lifespan; the three
schedules differ only in the budget, which is also their warm-up length:

* ZBV: p microbatches' worth (1F1B's peak), zero bubble when F = B = W;
* V-half: (p+2)//2, about half of 1F1B's memory, with about half of its bubble;
* V-min: (p+4)//3, about a third of the memory, with about two thirds of 1F1B's bubble.

Budgets are in 1F1B-stage microbatches; a chunk's activation is half of one (vpp = 2).

Two constructions compete under the request's costs, and the shorter step wins: the paper's repeated
building block (:mod:`~primuspipe.algorithms.building_blocks`; its lifespans give about p/3 microbatches,
so it is tried wherever it fits the budget, and it is what keeps V-min near two thirds of 1F1B's bubble
at large p) and the greedy list scheduler capped at the budget (which uses a larger budget better).
"""

from __future__ import annotations

from primuspipe.algorithms.building_blocks import block_orders
from primuspipe.algorithms.list_scheduler import FillPolicy, best_fill, unit_costs
from primuspipe.algorithms.phases import require
from primuspipe.algorithms.registry import ScheduleRequest, register
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable


def fill_policies(p: int, cap: int, max_deferred_w: int) -> list[FillPolicy]:
    """Greedy policies tried, as (reserve, backward first) pairs.

    The reserve is the chunk-activation slots kept for chunk-1 forwards (which start the backward
    wave): one is the least that never stalls, a larger one injects new microbatches more slowly, which
    pays at large p (about a sixth of the cap was best in our sweeps at p = 16 and 32). Forward-first
    tie breaks win under uneven costs (B much slower than F)."""
    pairs = [(1, True), (1, False), (2, True), (2, False)]
    if cap // 6 > 2:
        pairs += [(cap // 6, True), (cap // 6, False)]
    return [FillPolicy((cap,) * p, reserve, first, (max_deferred_w,) * p) for reserve, first in pairs if reserve < cap]


def vshape_schedule(req: ScheduleRequest, budget: int, algorithm: str, p2p_time: float,
                    max_deferred_w: int | None) -> ScheduleTable:
    """A V-shape schedule holding at most ``budget`` microbatches (1F1B-stage units) per rank from F to
    B, deferring at most ``max_deferred_w`` W's per rank (default: as many as the budget's chunks)."""
    require(req.vpp == 2, algorithm, f"is a V-shape schedule with 2 chunks per rank, got vpp = {req.vpp}")
    require(max_deferred_w is None or max_deferred_w >= 1, algorithm,
            f"max_deferred_w must be >= 1 (a W follows its B), got {max_deferred_w}")
    p = req.pp
    cap = 2 * budget  # in chunk activations
    deferred = cap if max_deferred_w is None else max_deferred_w
    placement = Placement.vshape(p)
    costs = req.costs or unit_costs(placement.num_stages)
    # Building blocks: one microbatch's chain laid out on the period (with the real costs, blended
    # toward uniform ones down to the paper's block), repeated m times, squeezed, W's filling the waits
    # under the real costs; kept where the order stays within the budget.
    blocks = block_orders(placement, req.microbatches, costs, p2p_time, cap, deferred)
    # Warm-up: chunk-0 forwards until the budget less the reserve is held; chunk-1 forwards of the
    # first microbatches follow as soon as they come back up the V.
    # Steady: each B frees a slot, the next forward takes it; W's fill the waits.
    # Cool-down: the last B's, with the deferred W's filling the gaps between them.
    return best_fill(placement, req.microbatches, costs, [*blocks, *fill_policies(p, cap, deferred)], p2p_time=p2p_time,
                     algorithm=algorithm)


@register("zbv", placement="v", vpp=2, split_backward=True)
def zbv(req: ScheduleRequest, *, p2p_time: float = 0.0, max_deferred_w: int | None = None) -> ScheduleTable:
    """ZBV: V-shape zero bubble at 1F1B's activation memory (p microbatches per rank).

    Its compute order at pp=4, m=4 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 f0 b0 f1 b1 f2 b2 f3 b3 B0 w0 B1 w1 B2 w2 B3 w3 W0 W1 W2 W3
        rank 1 | F0 F1 F2 F3 f0 f1 b0 f2 b1 f3 b2 B0 b3 B1 w0 B2 w1 B3 w2 W0 w3 W1 W2 W3
        rank 2 | F0 F1 F2 f0 F3 f1 f2 b0 f3 b1 B0 b2 B1 b3 B2 w0 B3 w1 W0 w2 W1 w3 W2 W3
        rank 3 | F0 f0 F1 f1 F2 f2 F3 f3 b0 B0 b1 B1 b2 B2 b3 B3 w0 W0 w1 W1 w2 W2 w3 W3
    """
    return vshape_schedule(req, req.pp, "zbv", p2p_time, max_deferred_w)


@register("v-half", placement="v", vpp=2, split_backward=True)
def v_half(req: ScheduleRequest, *, p2p_time: float = 0.0, max_deferred_w: int | None = None) -> ScheduleTable:
    """V-half: V-shape at (p+2)//2 microbatches of activations, about half of 1F1B's bubble.

    Its compute order at pp=4, m=5 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 F4 f0 b0 w0 f1 b1 w1 f2 b2 f3 b3 B0 B1 w2 w3 f4 b4 W0 W1 B2 B3 w4 W2 B4 W3 W4
        rank 1 | F0 F1 F2 F3 F4 f0 b0 f1 w0 b1 f2 B0 f3 b2 B1 b3 w1 W0 f4 w2 W1 b4 B2 B3 w3 w4 B4 W2 W3 W4
        rank 2 | F0 F1 F2 f0 F3 f1 b0 f2 w0 B0 b1 f3 W0 B1 F4 b2 b3 f4 w1 W1 B2 B3 b4 w2 w3 B4 W2 W3 w4 W4
        rank 3 | F0 f0 F1 f1 F2 f2 b0 B0 F3 f3 b1 B1 w0 W0 F4 f4 b2 b3 B2 B3 w1 W1 b4 B4 w2 w3 W2 W3 w4 W4
    """
    return vshape_schedule(req, (req.pp + 2) // 2, "v-half", p2p_time, max_deferred_w)


@register("v-min", placement="v", vpp=2, split_backward=True)
def v_min(req: ScheduleRequest, *, p2p_time: float = 0.0, max_deferred_w: int | None = None) -> ScheduleTable:
    """V-min: V-shape at (p+4)//3 microbatches of activations, about two thirds of 1F1B's bubble.

    Its compute order at pp=4, m=6 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 f0 b0 F2 w0 f1 b1 B0 F3 w1 W0 f2 b2 B1 F4 w2 W1 f3 b3 B2 F5 w3 W2 f4 b4 B3 w4 W3 f5 b5 B4 w5 W4 B5 W5
        rank 1 | F0 f0 F1 b0 w0 f1 F2 B0 b1 W0 w1 f2 F3 B1 b2 W1 w2 f3 F4 B2 b3 W2 w3 f4 F5 B3 b4 W3 w4 f5 B4 b5 W4 w5 B5 W5
        rank 2 | F0 f0 F1 b0 f1 w0 B0 F2 W0 b1 f2 w1 B1 F3 W1 b2 f3 w2 B2 F4 W2 b3 f4 w3 B3 F5 W3 b4 f5 w4 B4 W4 b5 w5 B5 W5
        rank 3 | F0 f0 F1 f1 b0 B0 w0 W0 F2 f2 b1 B1 w1 W1 F3 f3 b2 B2 w2 W2 F4 f4 b3 B3 w3 W3 F5 f5 b4 B4 w4 W4 b5 B5 w5 W5
    """
    return vshape_schedule(req, (req.pp + 4) // 3, "v-min", p2p_time, max_deferred_w)
