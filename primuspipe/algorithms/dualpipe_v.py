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

from collections import deque

from primuspipe.algorithms.phases import require
from primuspipe.algorithms.registry import ScheduleRequest, register
from primuspipe.ir.node import FB, B, F, NodeKind, ScheduleNode, W
from primuspipe.ir.placement import Placement
from primuspipe.passes.overlap import lower_overlap
from primuspipe.ir.table import ScheduleTable


class _RankProgram:
    """One rank's node list under construction: next microbatch per chunk and kind, deferred W's."""

    def __init__(self) -> None:
        self.nodes: list[ScheduleNode] = []
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.deferred: deque[tuple[int, int]] = deque()

    def _take(self, counters: list[int], chunk: int) -> int:
        counters[chunk] += 1
        return counters[chunk] - 1

    def forward(self, chunk: int) -> None:
        self.nodes.append(F(self._take(self.next_f, chunk), chunk))

    def _finish_backward(self, mb: int, chunk: int, zero_bubble: bool) -> None:
        if zero_bubble:
            self.deferred.append((mb, chunk))
        else:
            self.nodes.append(W(mb, chunk))

    def backward(self, chunk: int, *, zero_bubble: bool = False) -> None:
        mb = self._take(self.next_b, chunk)
        self.nodes.append(B(mb, chunk))
        self._finish_backward(mb, chunk, zero_bubble)

    def forward_backward(self, f_chunk: int, b_chunk: int) -> None:
        """Overlapped F of the next microbatch of ``f_chunk`` and full backward of ``b_chunk``'s."""
        f_mb = self._take(self.next_f, f_chunk)
        b_mb = self._take(self.next_b, b_chunk)
        self.nodes.append(FB(f_mb, f_chunk, b_mb, b_chunk))
        self._finish_backward(b_mb, b_chunk, zero_bubble=False)

    def weight(self) -> None:
        self.nodes.append(W(*self.deferred.popleft()))


def dualpipe_v_rank(p: int, m: int, rank: int) -> list[ScheduleNode]:
    """The node list of ``rank``; each phase's count is computed from the rank's place in the V."""
    prog = _RankProgram()
    last = rank == p - 1
    to_end = p - rank - 1  # ranks between this one and the bottom of the V
    # Phase 1, warm-up: chunk-0 forwards until the first microbatch comes back up the V.
    for _ in range(2 * to_end):
        prog.forward(0)
    # Phase 2: alternate chunk-0 and chunk-1 forwards.
    for _ in range(rank + 1):
        prog.forward(0)
        prog.forward(1)
    # Phase 3: chunk-1 B (W deferred), a deferred W, a chunk-1 forward.
    for _ in range(to_end):
        prog.backward(1, zero_bubble=True)
        prog.weight()
        prog.forward(1)
    # Phase 4, steady: overlapped pairs F0&B1, F1&B0 (the bottom rank's first pair is not
    # overlapped: its B1 needs the F1 of the very microbatch its F0 produces).
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and last:
            prog.forward(0)
            prog.backward(1)
        else:
            prog.forward_backward(0, 1)
        prog.forward_backward(1, 0)
    # Phase 5: forwards run out on chunk 0: B1, then F1&B0.
    for _ in range(to_end):
        prog.backward(1)
        prog.forward_backward(1, 0)
    # Phase 6, cool-down: B1, B0; the second half defers W's (odd ranks switch one B earlier).
    steps = rank + 1
    for i in range(steps):
        prog.backward(1, zero_bubble=i > steps // 2 or (i == steps // 2 and rank % 2 == 1))
        prog.backward(0, zero_bubble=i >= steps // 2)
    # Phase 7: a deferred W fills the wait for each remaining chunk-0 gradient.
    for _ in range(to_end):
        prog.weight()
        prog.backward(0, zero_bubble=True)
    # Phase 8: drain the deferred W's.
    while prog.deferred:
        prog.weight()
    assert prog.next_f == [m, m] and prog.next_b == [m, m], (rank, prog.next_f, prog.next_b)
    return prog.nodes


@register("dualpipe-v", placement="v", vpp=2, split_backward=True)
def dualpipe_v(req: ScheduleRequest, *, overlap: bool = True) -> ScheduleTable:
    """DualPipe-V: V-shape with overlapped F&B pairs (FB nodes); overlap=False lowers them to F, B."""
    p, m = req.pp, req.microbatches
    require(req.vpp == 2, "dualpipe-v", f"is a V-shape schedule with 2 chunks per rank, got vpp = {req.vpp}")
    require(m >= 2 * p, "dualpipe-v",
            f"needs at least 2*pp = {2 * p} microbatches to fill its V, got {m}; use zbv or v-half for fewer")
    table = ScheduleTable.build(Placement.vshape(p), m, [dualpipe_v_rank(p, m, r) for r in range(p)], "dualpipe-v")
    return table if overlap else lower_overlap(table)
