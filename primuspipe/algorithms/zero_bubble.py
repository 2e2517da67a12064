"""ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with the backward
split into B (input grad, on the critical path) and W (weight grad, free to move).

Both keep 1F1B's order of forwards and input-grad backwards and differ only in how many activations a
rank may hold, which is also its warm-up length:

* ZB-H1 keeps 1F1B's memory. Rank r warms up with p - r forwards, and counting a microbatch from its
  F until its W (a W needs the inputs of every GEMM, most of the activations), no rank holds more
  than p: 1F1B's peak. Because the backward wave now carries B only, it reaches rank 0 sooner, and
  the deferred W's fill the waits: bubble (p-1)(F+B-W), a third of 1F1B's when F = B = W.
* ZB-H2 lets rank r warm up with 2(p - r) - 1 forwards within 2p - 1 microbatches held until W,
  filling the start-up bubble with forwards; the W's fill the cool-down, so no rank idles within its
  own span when F = B = W.

The paper draws both as one pattern (:func:`zero_bubble_pattern`): rank r warms up with some forwards,
then after each B runs the W it deferred ``lag`` backwards earlier and the next forward, and ends with
the W's still deferred. ZB-H1 is warm-up p - r, lag r; ZB-H2 warm-up 2(p - r) - 1, lag 2r; in both the
warm-up plus the lag is the rank's memory (p, and 2p - 1). The algorithms keep the faster, as
simulated, of the list scheduler's greedy fills under those caps
(:mod:`~primuspipe.algorithms.list_scheduler`, :mod:`~primuspipe.algorithms.competition`), which adapt
to uneven costs, and the pattern, which competes last: it is the table where it is strictly faster,
so neither algorithm is ever slower than its paper's figure. The table's
:class:`~primuspipe.ir.table.Construction` says which one it is. With F = B = W, free P2P and m >= p,
ZB-H1's table is the paper's pattern (with fewer microbatches, a fill of equal step); ZB-H2's fill runs
each B as soon as it arrives and defers more W's than the pattern, as fast there. With P2P time the
pattern often wins (bench/bench_constructions.py: at P2P 0.1 of F it was up to 8.8 % (ZB-H1) and 2.7 %
(ZB-H2) shorter than the best fill).
"""

from __future__ import annotations

from primuspipe.algorithms.competition import Paper, best_fill
from primuspipe.algorithms.list_scheduler import FillPolicy
from primuspipe.algorithms.phases import RankProgram
from primuspipe.algorithms.registry import ScheduleRequest, register
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable


def zero_bubble_pattern(m: int, warmup: int, lag: int) -> list[ScheduleNode]:
    """One rank's order in the Zero Bubble paper's handcrafted schedules (ZB-H1, ZB-H2)::

        F x warmup | B W(lag backwards ago) F | ... | B W | ... | W W ...
         warm-up      steady: one of each        cool-down    the deferred W's

    The W's a rank defers are the ones that fill its waits for the backward wave: the further down the
    pipeline (the earlier the B's arrive), the fewer."""
    prog = RankProgram()
    for _ in range(min(warmup, m)):
        prog.forward(0)
    for j in range(m):
        prog.backward(0, zero_bubble=True)
        if j >= lag:
            prog.weight()
        if prog.next_f[0] < m:
            prog.forward(0)
    while prog.deferred:
        prog.weight()
    return prog.nodes


def _paper(name: str, p: int, m: int, warmup, lag) -> Paper:
    rows = [zero_bubble_pattern(m, warmup(r), lag(r)) for r in range(p)]
    return Paper(name, ScheduleTable.build(Placement.interleaved(p, 1), m, rows, name))


@register("zb-h1", vpp=1, split_backward=True)
def zb_h1(req: ScheduleRequest) -> ScheduleTable:
    """ZB-H1: 1F1B's activation memory (p on rank 0), bubble (p-1)(F+B-W) with deferred W's.

    Its compute order at pp=4, m=6 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5
        rank 1 | F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5
        rank 2 | F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5
        rank 3 | F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5
    """
    p = req.pp
    # Warm-up: rank r runs p - r forwards before its first B (1F1B's count), which is also its cap.
    warmup = tuple(p - r for r in range(p))
    # Steady: each B frees the slot of the next F; a W runs only where the rank would otherwise wait.
    # Cool-down: the remaining B's, with the deferred W's filling the gaps between their arrivals.
    # Memory: counted until W, no rank holds more than p microbatches (1F1B's peak, rank 0's): a
    # forward that would exceed it waits for deferred W's, whatever m is.
    paper = _paper("the paper's ZB-H1 pattern", p, req.microbatches, lambda r: p - r, lambda r: r)
    return best_fill(Placement.interleaved(p, 1), req.microbatches, req.cost_model(), _policies(warmup, p),
                     algorithm="zb-h1", paper=paper)


@register("zb-h2", vpp=1, split_backward=True)
def zb_h2(req: ScheduleRequest) -> ScheduleTable:
    """ZB-H2: up to 2p-1 activations on rank 0; extra warm-up forwards fill the start-up bubble.

    Its compute order at pp=4, m=5 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 F4 B0 W0 B1 W1 B2 W2 B3 W3 B4 W4
        rank 1 | F0 F1 F2 F3 F4 B0 W0 B1 W1 B2 W2 B3 W3 B4 W4
        rank 2 | F0 F1 F2 B0 F3 B1 F4 B2 W0 B3 W1 B4 W2 W3 W4
        rank 3 | F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 W0 W1 W2 W3 W4
    """
    p = req.pp
    # Warm-up: rank r runs 2(p - r) - 1 forwards: enough to stay busy until its first B arrives.
    warmup = tuple(2 * (p - r) - 1 for r in range(p))
    # Steady and cool-down as in ZB-H1; the longer warm-up leaves more W's to fill the tail.
    # Memory: no rank holds more than 2p - 1 microbatches until their W, whatever m is.
    paper = _paper("the paper's ZB-H2 pattern", p, req.microbatches, lambda r: 2 * (p - r) - 1, lambda r: 2 * r)
    return best_fill(Placement.interleaved(p, 1), req.microbatches, req.cost_model(), _policies(warmup, 2 * p - 1),
                     algorithm="zb-h2", paper=paper)


def _policies(warmup: tuple[int, ...], memory: int) -> list[FillPolicy]:
    """A ready forward goes before a ready backward (so B's arriving back to back cannot starve the
    forward wave while W's are at their limit); the other tie-break is kept where costs make it faster."""
    return [FillPolicy(warmup, (float(memory),) * len(warmup), 0, backward_first) for backward_first in (False, True)]
