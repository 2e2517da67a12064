"""What a node costs beyond its kind's plain time by where it stands in its rank's row: the warm W, the window.

Two measured effects depend on a node's neighbours, not on its kind and stage: a W right after its own B (or
another W of its chunk) runs warm, and the node that opens a stretch of deferred Ws runs long. Each is one rule
on a row of nodes, kept apart from the cost model (:mod:`~primuspipe.ir.cost_model`), which prices them, because
the simulator charges by the same rules that calibration sorts measured nodes by
(:mod:`~primuspipe.calibration.walk`): a rule defined twice would let the two drift.
"""

from __future__ import annotations

from collections.abc import Sequence

from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode


def warm_weight_grad(previous: ScheduleNode | None, node: ScheduleNode) -> bool:
    """Whether ``node`` is a *warm* W: its rank ran, just before it (``previous``: the rank's compute node
    before it, communication between them aside), the B of the same microbatch and chunk -- whose output
    gradients it reads -- or another W of the same chunk -- whose weight-gradient buffers it adds to.
    Measured on CPU, such a W took 10-20 % less than one after a forward or another microbatch's B
    (docs/simulator.md). The simulator charges W by it (:attr:`~primuspipe.ir.cost_model.CostModel.w_warm`)
    and calibration sorts measured W by it, with this one rule.

    >>> from primuspipe.ir.node import B, F, W
    >>> [warm_weight_grad(before, W(3)) for before in (B(3), W(2), B(4), F(5), W(2, 1))]
    [True, True, False, False, False]
    """
    if node.kind is not NodeKind.W or previous is None:
        return False
    return any(p.chunk == node.chunk
               and (p.kind is NodeKind.W or p.kind is NodeKind.B and p.microbatch == node.microbatch)
               for p in previous.parts())


def window_openings(row: Sequence[ScheduleNode]) -> list[bool]:
    """Per node of a rank's row, in table order: whether it opens a *window* -- the first node to start
    while the rank holds the inputs of a W whose B has run, after a stretch holding none. A node that
    completes only W never opens one (a W is priced by its own context, :func:`warm_weight_grad`), nor
    does a communication or host-copy node; the window stays open through them until no W is pending.

    Why the opening only: measured on CPU, the extra time of a window falls on its first node, when the
    rank first keeps a deferred W's inputs beside its working set (the allocator finds fresh memory
    once); the nodes after it run at their kind's plain time. The split probe's windows at pp = 2,
    hidden 256: the first F 24-26 ms where the rank's other Fs took 19-20, the next F in the same window
    20 ms. ZB-H2's first rank, holding a deferred W through 9 nodes in a row (its unit-cost table): F
    +3.8 % and B +1.3 % over the same run's others, about 5 ms a step, where charging every node of the
    window the probe's share gave 20 ms and charging its opening gives 5 (docs/simulator.md).
    :attr:`~primuspipe.ir.cost_model.CostModel.probe_window` prices each opening, in any table; where it is measured is
    :func:`probe_windows`.

    >>> from primuspipe.ir.node import B, F, W
    >>> window_openings([F(0), B(0), F(1), B(1), W(0), F(2), B(2), W(1), W(2), F(3), B(3), F(4)])
    [False, False, True, False, False, False, False, False, False, False, False, True]
    """
    pending: set[tuple[int, int]] = set()  # (chunk, microbatch) whose B ran and whose W has not
    out = []
    is_open = False
    for node in row:
        parts = node.parts()
        opens = (bool(pending) and not is_open and not node.kind.on_host_stream
                 and any(not (p.kind.is_weight_grad and not p.kind.is_input_grad) for p in parts))
        out.append(opens)
        is_open = is_open or opens
        for p in parts:
            if p.kind.is_input_grad != p.kind.is_weight_grad:
                (pending.add if p.kind.is_input_grad else pending.discard)((p.chunk, p.microbatch))
        is_open = is_open and bool(pending)
    return out


def probe_windows(row: Sequence[ScheduleNode]) -> list[bool]:
    """:func:`window_openings` of a rank that runs fused backwards (a kind completing both the B and
    the W step), the windows the split probe (:mod:`primuspipe.passes.split_probe`) opens in a 1F1B step;
    none elsewhere. Calibration times the nodes that open them apart and measures
    :attr:`~primuspipe.ir.cost_model.CostModel.probe_window` from them, per rank, with this one rule: beside the same kind's nodes with nothing pending, which a
    fused-backward step has and a split-backward one's later ranks mostly lack. Measured on CPU (hidden 128
    and 256) they took 2-46 % more CPU than the step's others (median over a run's), most of it minor page
    faults (glibc handing freed memory back to the kernel: a rank holding more than it held elsewhere in
    the step faults it back in); ranks that keep freed memory (:mod:`primuspipe.testing.host_memory`)
    measure a share of 0-2 % at hidden 128 (docs/simulator.md). The share differs by rank, as what each
    holds does (pp = 2, hidden 256, over every node of a window: the first rank's 5-11 %, the last rank's
    0.3-3 %; over the openings alone, one run: 23 % and 10 %).

    >>> from primuspipe.ir.node import B, BW, F, W
    >>> probe_windows([F(0), F(1), B(0), F(2), W(0), BW(1)]), probe_windows([F(0), F(1), B(0), F(2), W(0)])
    ([False, False, False, True, False, False], [False, False, False, False, False])
    """
    if not any(p.kind.is_input_grad and p.kind.is_weight_grad for node in row for p in node.parts()):
        return [False] * len(row)
    return window_openings(row)
