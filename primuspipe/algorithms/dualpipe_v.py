"""DualPipe-V (DeepSeek, the "cut-in-half" DualPipe of DeepSeek-V3): a V-shape schedule whose steady
phase overlaps the forward of one microbatch with the input-grad backward of another, on one rank.

Each rank holds chunk 0 (stage r) and chunk 1 (stage 2p-1-r). The schedule runs eight phases whose
lengths depend on the rank's distance from either end of the V; the steady phase (4) is pairs of
overlapped nodes, ``FB(F chunk 0, B chunk 1)`` then ``FB(F chunk 1, B chunk 0)``. A "full" backward
is a B immediately followed by its W (DeepSeek's B is our B + W); a zero-bubble backward defers its
W to a FIFO that phases 3, 7 and 8 drain into the waits. In DeepSeek's notation (B = full backward,
F&B = an overlapped pair) the bubble is (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages.

Runners that cannot overlap two microbatches get the same order with each FB lowered to F then B
(``overlap=False`` or :func:`~primuspipe.passes.overlap.lower_overlap`).
"""

from __future__ import annotations

from primuspipe.algorithms.phases import RankProgram, require
from primuspipe.algorithms.registry import ScheduleRequest, register
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.passes.overlap import lower_overlap
from primuspipe.ir.table import ScheduleTable


def dualpipe_v_rank(p: int, m: int, rank: int) -> list[ScheduleNode]:
    """The node list of ``rank``, phase by phase in DeepSeek's notation: ``nF0`` is n forwards of
    chunk 0, ``F0B1`` an overlapped pair, a trailing ``W`` a deferred weight gradient. Every count is
    the rank's place in the V: ``below`` ranks lie between it and the bottom of the V, ``above``
    (= rank) between it and the top."""
    prog = RankProgram()
    below, above = p - rank - 1, rank
    bottom = rank == p - 1
    warmup_f0 = 2 * below  # nF0: until microbatch 0 comes back up the V to chunk 1
    alternating_f0f1 = above + 1  # nF0F1
    zero_bubble_b1w1f1 = below  # nB1W1F1: W deferred, the oldest deferred W runs at once
    steady_f0b1f1b0 = m - 2 * p + above + 1  # nF0B1F1B0, the main phase
    drain_b1f1b0 = below  # nB1F1B0: chunk-0 forwards have run out
    cooldown_b1b0 = above + 1  # nB1B0: the second half defers its W's
    fill_wb0 = below  # nWB0: a deferred W fills each wait for a chunk-0 gradient

    for _ in range(warmup_f0):
        prog.forward(0)
    for _ in range(alternating_f0f1):
        prog.forward(0)
        prog.forward(1)
    for _ in range(zero_bubble_b1w1f1):
        prog.backward(1, zero_bubble=True)
        prog.weight()
        prog.forward(1)
    for i in range(steady_f0b1f1b0):
        if i == 0 and bottom:  # its B1 needs the F1 of the microbatch its F0 produces: no overlap yet
            prog.forward(0)
            prog.backward(1)
        else:
            prog.forward_backward(0, 1)
        prog.forward_backward(1, 0)
    for _ in range(drain_b1f1b0):
        prog.backward(1)
        prog.forward_backward(1, 0)
    half = cooldown_b1b0 // 2
    for i in range(cooldown_b1b0):  # odd ranks switch to deferred W's one B earlier
        prog.backward(1, zero_bubble=i > half or (i == half and rank % 2 == 1))
        prog.backward(0, zero_bubble=i >= half)
    for _ in range(fill_wb0):
        prog.weight()
        prog.backward(0, zero_bubble=True)
    while prog.deferred:  # nW: drain the deferred W's
        prog.weight()
    assert prog.next_f == [m, m] and prog.next_b == [m, m], (rank, prog.next_f, prog.next_b)
    return prog.nodes


@register("dualpipe-v", placement="v", vpp=2, split_backward=True)
def dualpipe_v(req: ScheduleRequest, *, overlap: bool = True) -> ScheduleTable:
    """DualPipe-V: V-shape with overlapped F&B pairs (FB nodes); overlap=False lowers them to F, B.

    Its compute order at pp=4, m=8 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 F4 F5 F6 f0 b0 w0 f1 b1 w1 f2 b2 w2 f3 F7+b3 w3 f4+B0 W0 b4 w4 f5+B1 W1 b5 w5 f6+B2 W2 b6 w6 f7+B3 W3 b7 w7 B4 W4 B5 W5 B6 W6 B7 W7
        rank 1 | F0 F1 F2 F3 F4 f0 F5 f1 b0 w0 f2 b1 w1 f3 F6+b2 w2 f4+B0 W0 F7+b3 w3 f5+B1 W1 b4 w4 f6+B2 W2 b5 w5 f7+B3 W3 b6 w6 B4 W4 b7 B5 w7 B6 W5 B7 W6 W7
        rank 2 | F0 F1 F2 f0 F3 f1 F4 f2 b0 w0 f3 F5+b1 w1 f4+B0 W0 F6+b2 w2 f5+B1 W1 F7+b3 w3 f6+B2 W2 b4 w4 f7+B3 W3 b5 w5 B4 W4 b6 w6 B5 b7 B6 W5 B7 w7 W6 W7
        rank 3 | F0 f0 F1 f1 F2 f2 F3 f3 F4 b0 w0 f4+B0 W0 F5+b1 w1 f5+B1 W1 F6+b2 w2 f6+B2 W2 F7+b3 w3 f7+B3 W3 b4 w4 B4 W4 b5 w5 B5 W5 b6 B6 b7 B7 w6 W6 w7 W7
    """
    p, m = req.pp, req.microbatches
    require(req.vpp == 2, "dualpipe-v", f"is a V-shape schedule with 2 chunks per rank, got vpp = {req.vpp}")
    require(m >= 2 * p, "dualpipe-v",
            f"needs at least 2*pp = {2 * p} microbatches to fill its V, got {m}; use zbv or v-half for fewer")
    table = ScheduleTable.build(Placement.vshape(p), m, [dualpipe_v_rank(p, m, r) for r in range(p)], "dualpipe-v")
    return table if overlap else lower_overlap(table)
