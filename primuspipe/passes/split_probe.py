"""A calibration probe for fused-backward schedules: a few ``BW`` nodes run as ``B`` then ``W``.

A run of 1F1B (or interleaved 1F1B) times F and the fused backward BW, but not what B and W cost when a
split-backward schedule (ZB-H1, ZBV, V-half, ...) runs them as two nodes: their shares of BW and the
extra time the split itself takes. What a W costs also depends on where it runs: right after its own B
its inputs are still in cache (ZB-H1's first rank, the V-shapes), after another node they are not
(ZB-H1's other ranks, ZB-H2). So this pass splits the backward of ``count`` microbatches of every chunk
into B and a W after the rank's next forward, and of ``count`` more (where the step has them) into B and
a W right after it -- the same order otherwise, the same gradients (W adds exactly what BW's weight
GEMMs add, in the same microbatch order) -- and a dump of that run gives ``primuspipe calibrate`` real B
and W times in both contexts next to BW (``compute.w`` and ``compute.w_after_b``, docs/simulator.md).

Takes and returns a compute-only table (add communication afterwards), like the other lowering passes.

>>> from primuspipe.algorithms.build import build_schedule
>>> probed = split_backward_probe(build_schedule("1f1b", pp=2, microbatches=5).compute_only())
>>> " ".join(map(str, probed.ranks[0]))
'F0.0 F1.0 BW0.0 F2.0 B1.0 W1.0 F3.0 B2.0 F4.0 W2.0 BW3.0 BW4.0'
"""

from __future__ import annotations

from primuspipe.errors import ConfigError, TableFormatError
from primuspipe.ir.kinds import NodeKind, step_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable


def probed_microbatches(microbatches: int, count: int) -> tuple[range, range]:
    """``(deferred, right after)``: the microbatches whose W the probe runs after the next forward --
    ``count`` from the middle of the step, where 1F1B's steady state has a forward after each backward
    -- and those whose W it runs right after their B: the ``count`` before them, or where the step has
    too few, those after them (as many as remain).

    >>> probed_microbatches(8, 1), probed_microbatches(2, 1)
    ((range(3, 4), range(2, 3)), (range(0, 1), range(1, 2)))
    """
    first = (microbatches - count) // 2
    deferred = range(first, first + count)
    if first >= count:
        return deferred, range(first - count, first)
    return deferred, range(first + count, min(microbatches, first + 2 * count))


def split_backward_probe(table: ScheduleTable, count: int = 1) -> ScheduleTable:
    """``table`` with the BW of microbatches from the middle of the step (:func:`probed_microbatches`),
    on every chunk, run as B and W: ``count`` of them as B, the rank's next forward, then W -- where a
    split-backward schedule's steady state often puts a W (ZB-H1's later ranks: after the next forward),
    so the probe pays what deferring it costs: inputs no longer in cache, more activations alive -- and
    up to ``count`` more as B then W at once (ZB-H1's first rank, the V-shapes). Where a backward comes
    next, a deferred W comes right after its B, so every weight still sums its microbatches' gradients in
    the table's order (the same gradients, bitwise)."""
    if table.has_communication:
        raise TableFormatError("split_backward_probe takes a compute-only table; pass table.compute_only() and add "
                               "communication afterwards")
    if not 1 <= count <= table.microbatches:
        raise ConfigError(f"split probe: count must be between 1 and the {table.microbatches} microbatches, "
                          f"got {count}")
    deferred, at_once = probed_microbatches(table.microbatches, count)

    def row_with_probes(row: tuple[ScheduleNode, ...]) -> list[ScheduleNode]:
        out: list[ScheduleNode] = []
        waiting: ScheduleNode | None = None  # a deferred W, placed after the next node if that is a forward
        for node in row:
            if waiting is not None and node.kind is not NodeKind.F:  # a later backward must not add its
                out.append(waiting)                                  # weight gradients first
                waiting = None
            split = node.kind is NodeKind.BW and (node.microbatch in deferred or node.microbatch in at_once)
            backward, weight_grad = (ScheduleNode(step_kind(step), node.microbatch, node.chunk)
                                     for step in node.kind.completes) if split else (node, None)
            out.append(backward)
            if waiting is not None:
                out.append(waiting)
                waiting = None
            if weight_grad is not None and node.microbatch in at_once:
                out.append(weight_grad)
            else:
                waiting = weight_grad
        return out if waiting is None else [*out, waiting]

    return table.with_ranks(map(row_with_probes, table.ranks))
