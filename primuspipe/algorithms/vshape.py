"""The V-shape family: ZBV (Qi et al., "Zero Bubble Pipeline Parallelism") and V-half / V-min (Qi et
al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

Each rank holds two chunks placed in a V (chunk 0 = stage r, chunk 1 = stage 2p-1-r), so rank 0 holds
the first and the last stage and the backward wave starts on the rank that started the forward wave.
A schedule's peak activation memory is its injection rate times the activations' lifespan; the three
schedules differ only in the budget, which is also their warm-up length:

* ZBV: p microbatches' worth (1F1B's peak), zero bubble when F = B = W;
* V-half: (p+2)//2, about half of 1F1B's memory, with about half of its bubble;
* V-min: (p+4)//3, about a third of the memory, with about two thirds of 1F1B's bubble.

Budgets are in 1F1B-stage microbatches (a chunk's activation is half of one), each microbatch counted
from its F until its W as the device holds it (docs/design.md §4), so a deferred W costs memory.

Several constructions compete under the request's cost model, and the shortest simulated step wins:

* the papers' building blocks (:mod:`~primuspipe.algorithms.building_blocks`): V-min's tight block and
  V-half's stretched one on the unit grid, squeezed within the budget, and blocks laid out with the
  real costs; their F/B order is then timed by the list scheduler, which places the W's;
* the greedy list scheduler capped at the budget (which uses a larger budget better);
* for ZBV, the Zero Bubble paper's hand-crafted order (:func:`zbv_handcrafted_rank`, the order
  torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` runs), as is and re-timed by the list
  scheduler, so ``zbv`` is never slower than that order under the given costs.

Each algorithm also writes out its paper's schedule -- ZBV's hand-crafted order, the V-min and V-half
blocks as the paper draws them (:func:`~primuspipe.algorithms.building_blocks.paper_block`, squeezed by
:func:`paper_block_schedule`) -- and the table's construction record names it where the chosen table is
it, or gives its simulated step beside the winner's (:mod:`~primuspipe.algorithms.competition`).
The paper's schedule competes last (V-min's block is also one of the competing blocks): it is the table
only where it is strictly faster, so no algorithm is slower than its paper's figure.
"""

from __future__ import annotations

from primuspipe.algorithms.building_blocks import block_orders, paper_block, squeezed_orders
from primuspipe.algorithms.competition import Filled, Paper, best_fill
from primuspipe.algorithms.list_scheduler import FillPolicy, FixedOrder, fixed_order_fill
from primuspipe.errors import ScheduleShapeError
from primuspipe.algorithms.phases import RankProgram, require
from primuspipe.algorithms.registry import ScheduleRequest, register
from primuspipe.ir.activations import peak_in_flight
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable


def fill_policies(p: int, cap: int) -> list[FillPolicy]:
    """Greedy policies tried, as (reserve, backward first) pairs, each holding at most ``cap`` chunk
    activations counted until W.

    The reserve is the chunk-activation slots kept for chunk-1 forwards (which start the backward
    wave): one is the least that never stalls, a larger one injects new microbatches more slowly, which
    pays at large p (about a sixth of the cap was best in our sweeps at p = 16 and 32). Forward-first
    tie breaks win under uneven costs (B much slower than F)."""
    pairs = [(1, True), (1, False), (2, True)]
    if cap // 6 > 2:
        pairs += [(cap // 6, True)]
    return [FillPolicy((cap,) * p, (float(cap),) * p, reserve, first) for reserve, first in pairs if reserve < cap]


def vshape_schedule(req: ScheduleRequest, budget: int, algorithm: str,
                    handcrafted: tuple[ScheduleTable, ...] = (), paper: Paper | None = None) -> ScheduleTable:
    """A V-shape schedule holding at most ``budget`` microbatches (1F1B-stage units) per rank, each
    counted from its F until its W (at the cost model's retained share between B and W); the
    ``handcrafted`` tables compete as they are and with their F/B order re-timed; ``paper`` is the
    paper's schedule, the last candidate and recorded beside the winner."""
    require(req.vpp == 2, algorithm, f"is a V-shape schedule with 2 chunks per rank, got vpp = {req.vpp}")
    policies, ready = vshape_candidates(req, 2 * budget, handcrafted)
    return best_fill(Placement.vshape(req.pp), req.microbatches, req.cost_model(), policies, algorithm=algorithm,
                     also=ready, paper=paper)


def paper_block_schedule(req: ScheduleRequest, algorithm: str, budget: int) -> Paper:
    """The Controllable Memory paper's schedule for ``algorithm`` (``v-min``, ``v-half``): its block
    (:func:`~primuspipe.algorithms.building_blocks.paper_block`) repeated once per microbatch, the W's
    put in the free slots and squeezed within ``budget`` (cool-down closed), then run in that F/B order
    as soon as the real costs allow, W's filling the waits. No table where the block's layout holds more
    than the budget or the order stalls."""
    name = f"the paper's {algorithm.replace('v-', 'V-')} block"
    placement, cap = Placement.vshape(req.pp), 2 * budget
    cost = req.cost_model(2)
    orders = squeezed_orders(placement, req.microbatches, paper_block(placement, algorithm), req.retained, cap)
    if orders is None:
        return Paper(name, None)
    order = orders[1]  # the cool-down closed
    try:
        rows = fixed_order_fill(placement, req.microbatches, cost, FixedOrder(order, cap, source=name),
                                algorithm=algorithm).rows
    except ScheduleShapeError:
        return Paper(name, None)
    return Paper(name, ScheduleTable.build(placement, req.microbatches, rows, algorithm))


def vshape_candidates(req: ScheduleRequest, cap: int, handcrafted: tuple[ScheduleTable, ...] = ()
                      ) -> tuple[list[FillPolicy | FixedOrder], list[Filled]]:
    """What competes for a V-shape schedule within ``cap`` chunk activations per rank (counted until
    W): fill policies for the list scheduler, and ready-made tables (the ``handcrafted`` ones that fit)."""
    p = req.pp
    placement = Placement.vshape(p)
    cost = req.cost_model(2)
    fitting = [t for t in handcrafted if max(peak_in_flight(t, req.retained)) * 2 <= cap + 1e-9]
    # Building blocks: one microbatch's chain laid out on the period (uniform and squeezed, or with the
    # real costs blended toward uniform ones), repeated m times, its F/B order timed under the real
    # costs with the W's filling the waits; kept where the order stays within the budget.
    blocks = block_orders(placement, req.microbatches, cost, cap)
    # Warm-up: chunk-0 forwards until the budget less the reserve is held; chunk-1 forwards of the
    # first microbatches follow as soon as they come back up the V.
    # Steady: each B frees a slot, the next forward takes it; W's fill the waits, and run before a
    # forward that would exceed the budget.
    # Cool-down: the last B's, with the deferred W's filling the gaps between them.
    orders = [FixedOrder(forward_backward_order(t), cap, lookahead, f"{t.algorithm} F/B order")
              for t in fitting for lookahead in (False, True)]
    return [*orders, *blocks, *fill_policies(p, cap)], [Filled(t, t.algorithm, 0.0) for t in fitting]


def forward_backward_order(table: ScheduleTable) -> tuple[tuple[tuple[NodeKind, int], ...], ...]:
    """Each rank's F and B nodes of a compute-only split-backward table, as ``(kind, chunk)``."""
    return tuple(tuple((n.kind, n.chunk) for n in row if n.kind in (NodeKind.F, NodeKind.B)) for row in table.ranks)


def zbv_handcrafted_rank(p: int, m: int, rank: int) -> list[ScheduleNode]:
    """The Zero Bubble paper's hand-crafted ZBV order of ``rank``, phase by phase (``F0`` a forward of
    chunk 0, ``B1W1`` an input-grad backward of chunk 1 and its W at once). The pattern needs 2p - 1
    microbatches; with fewer it is written for 2p - 1 and the missing microbatches' nodes dropped."""
    prog = RankProgram()
    n = max(2 * p - 1, m)
    above, below = rank, p - rank
    for _ in range(2 * below - 1):  # warm-up: nF0, until microbatch 0 comes back up the V
        prog.forward(0)
    for _ in range(above):  # nF1F0
        prog.forward(1)
        prog.forward(0)
    for _ in range(below):  # nF1B1W1: chunk 1's backward starts at once
        prog.forward(1)
        prog.backward(1)
    while prog.next_f[1] < prog.next_f[0] or prog.next_f[0] < n:  # steady: F0 B0W0 F1 B1W1
        if prog.next_f[0] < n:
            prog.forward(0)
        prog.backward(0)
        prog.forward(1)
        prog.backward(1)
    for _ in range(above):  # cool-down: nB0B1, W's deferred
        prog.backward(0, zero_bubble=True)
        prog.backward(1, zero_bubble=True)
    for _ in range(below):  # nB0W0: each B0 followed by the oldest deferred chunk-0 W
        prog.backward(0, zero_bubble=True)
        prog.weight(0)
    while any(c == 1 for _, c in prog.deferred):  # the deferred W's, chunk 1's first
        prog.weight(1)
    while prog.deferred:
        prog.weight(0)
    return [node for node in prog.nodes if all(mb < m for _, mb, _ in node.parts())]


def zbv_handcrafted(p: int, m: int) -> ScheduleTable:
    """The hand-crafted ZBV table (:func:`zbv_handcrafted_rank`)."""
    return ScheduleTable.build(Placement.vshape(p), m, [zbv_handcrafted_rank(p, m, r) for r in range(p)],
                               "hand-crafted ZBV")


@register("zbv", placement="v", vpp=2, split_backward=True)
def zbv(req: ScheduleRequest) -> ScheduleTable:
    """ZBV: V-shape zero bubble at 1F1B's activation memory (p microbatches per rank).

    Its compute order at pp=4, m=4 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 f0 b0 f1 b1 f2 b2 f3 b3 B0 w0 B1 w1 B2 w2 B3 w3 W0 W1 W2 W3
        rank 1 | F0 F1 F2 F3 f0 f1 b0 f2 b1 f3 b2 B0 b3 B1 w0 B2 w1 B3 w2 W0 w3 W1 W2 W3
        rank 2 | F0 F1 F2 f0 F3 f1 f2 b0 f3 b1 B0 b2 B1 b3 B2 w0 B3 w1 W0 w2 W1 w3 W2 W3
        rank 3 | F0 f0 F1 f1 F2 f2 F3 f3 b0 B0 b1 B1 b2 B2 b3 B3 w0 W0 w1 W1 w2 W2 w3 W3
    """
    handcrafted = zbv_handcrafted(req.pp, req.microbatches)
    return vshape_schedule(req, req.pp, "zbv", (handcrafted,), Paper("the paper's hand-crafted ZBV order", handcrafted))


@register("v-half", placement="v", vpp=2, split_backward=True)
def v_half(req: ScheduleRequest) -> ScheduleTable:
    """V-half: V-shape at (p+2)//2 microbatches of activations, about half of 1F1B's bubble.

    Its compute order at pp=4, m=5 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 F4 f0 b0 w0 f1 b1 w1 f2 b2 B0 w2 W0 f3 b3 B1 w3 W1 f4 b4 B2 w4 B3 W2 W3 B4 W4
        rank 1 | F0 F1 F2 F3 f0 f1 b0 w0 f2 b1 w1 B0 F4 b2 W0 f3 w2 B1 b3 W1 w3 f4 B2 b4 B3 W2 w4 W3 B4 W4
        rank 2 | F0 F1 F2 f0 f1 f2 b0 w0 F3 B0 b1 W0 w1 f3 F4 B1 b2 W1 w2 f4 b3 B2 w3 B3 b4 W2 W3 B4 w4 W4
        rank 3 | F0 f0 F1 f1 F2 f2 b0 B0 w0 F3 W0 f3 b1 B1 w1 F4 W1 f4 b2 B2 b3 B3 w2 W2 b4 B4 w3 W3 w4 W4
    """
    budget = (req.pp + 2) // 2
    return vshape_schedule(req, budget, "v-half", paper=paper_block_schedule(req, "v-half", budget))


@register("v-min", placement="v", vpp=2, split_backward=True)
def v_min(req: ScheduleRequest) -> ScheduleTable:
    """V-min: V-shape at (p+4)//3 microbatches of activations, about two thirds of 1F1B's bubble.

    Its compute order at pp=4, m=6 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 f0 b0 w0 f1 b1 w1 F3 B0 W0 f2 b2 B1 w2 F4 W1 f3 b3 B2 w3 F5 W2 f4 b4 B3 w4 W3 f5 b5 B4 w5 W4 B5 W5
        rank 1 | F0 F1 f0 f1 b0 w0 F2 b1 w1 B0 F3 W0 f2 B1 b2 W1 w2 f3 F4 B2 b3 W2 w3 f4 F5 B3 b4 W3 w4 f5 B4 b5 W4 w5 B5 W5
        rank 2 | F0 F1 f0 f1 b0 w0 F2 B0 b1 W0 w1 f2 F3 B1 W1 b2 f3 w2 B2 F4 W2 b3 f4 w3 B3 F5 W3 b4 f5 w4 B4 W4 b5 w5 B5 W5
        rank 3 | F0 f0 F1 f1 b0 B0 w0 F2 W0 f2 b1 B1 w1 F3 W1 f3 b2 B2 w2 W2 F4 f4 b3 B3 w3 W3 F5 f5 b4 B4 w4 W4 b5 B5 w5 W5
    """
    budget = (req.pp + 4) // 3
    return vshape_schedule(req, budget, "v-min", paper=paper_block_schedule(req, "v-min", budget))
