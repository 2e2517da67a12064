"""A calibration probe for fused-backward schedules: a few ``BW`` nodes run as ``B`` then ``W``.

A run of 1F1B (or interleaved 1F1B) times F and the fused backward BW, but not what B and W cost when a
split-backward schedule (ZB-H1, ZBV, V-half, ...) runs them as two nodes: their shares of BW and the
extra time the split itself takes. What a W costs also depends on where it runs: right after its own B
its inputs are still in cache (ZB-H1's first rank, the V-shapes); ZB-H1's later ranks and ZB-H2 run it
after another microbatch's B. So this pass splits the backward of a few microbatches of every chunk
into B and W, some Ws deferred past the next microbatch's B, some right after their own B -- the same
order otherwise, the same gradients (W adds exactly what BW's weight GEMMs add, in the same microbatch
order) -- and a dump of that run gives ``primuspipe calibrate`` real B and W times in both contexts next
to BW (``compute.w`` and ``compute.w_warm``, docs/simulator.md).

Takes and returns a compute-only table (add communication afterwards), like the other lowering passes.

>>> from primuspipe.algorithms.build import build_schedule
>>> probed = split_backward_probe(build_schedule("1f1b", pp=2, microbatches=5).compute_only())
>>> " ".join(map(str, probed.ranks[0]))
'F0.0 F1.0 BW0.0 F2.0 B1.0 W1.0 F3.0 B2.0 F4.0 B3.0 W2.0 W3.0 BW4.0'
"""

from __future__ import annotations

from primuspipe.errors import ConfigError, TableFormatError
from primuspipe.ir.kinds import NodeKind, step_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable


def probed_microbatches(microbatches: int, count: int) -> tuple[range, range]:
    """``(deferred, right after)``: from the middle of the step, ``count`` microbatches whose W runs right
    after their own B, then a run of ``count + 1`` whose Ws are deferred -- each after the next one's B,
    the last right after the W before it; as many as the step has.

    >>> probed_microbatches(8, 1), probed_microbatches(8, 2), probed_microbatches(2, 1)
    ((range(3, 5), range(2, 3)), (range(3, 6), range(1, 3)), (range(1, 2), range(0, 1)))
    """
    first = max(0, (microbatches - 2 * count - 1) // 2)
    at_once = range(first, min(microbatches, first + count))
    return range(at_once.stop, min(microbatches, at_once.stop + count + 1)), at_once


def split_backward_probe(table: ScheduleTable, count: int = 1) -> ScheduleTable:
    """``table`` with the BW of microbatches from the middle of the step (:func:`probed_microbatches`),
    on every chunk, run as B and W: ``count`` with W right after their B (ZB-H1's first rank, the
    V-shapes: a warm W, :func:`~primuspipe.ir.row_context.warm_weight_grad`, the first of them the chunk's
    first W of the step), then a run of ``count + 1`` with each W deferred past the next one's B (where
    ZB-H1's later ranks and ZB-H2 put a W: a cold one), the last W right after the one before it (warm
    again, as ZB-H2's second W of a pair). A W is never moved past a backward that is not split, so every
    weight still sums its microbatches' gradients in the table's order (the same gradients, bitwise)."""
    if table.has_communication:
        raise TableFormatError("split_backward_probe takes a compute-only table; pass table.compute_only() and add "
                               "communication afterwards")
    if not 1 <= count <= table.microbatches:
        raise ConfigError(f"split probe: count must be between 1 and the {table.microbatches} microbatches, "
                          f"got {count}")
    deferred, at_once = probed_microbatches(table.microbatches, count)

    def row_with_probes(row: tuple[ScheduleNode, ...]) -> list[ScheduleNode]:
        out: list[ScheduleNode] = []
        waiting: dict[int, ScheduleNode] = {}  # chunk -> its deferred W, placed after the chunk's next B
        for node in row:
            split = node.kind is NodeKind.BW and (node.microbatch in deferred or node.microbatch in at_once)
            if node.kind is NodeKind.BW and not split and node.chunk in waiting:  # a later backward must not add
                out.append(waiting.pop(node.chunk))                               # its weight gradients first
            if not split:
                out.append(node)
                continue
            backward, weight_grad = (ScheduleNode(step_kind(step), node.microbatch, node.chunk)
                                     for step in node.kind.completes)
            out.append(backward)
            if node.chunk in waiting:
                out.append(waiting.pop(node.chunk))
            if node.microbatch in deferred and node.microbatch != deferred[-1]:
                waiting[node.chunk] = weight_grad
            else:
                out.append(weight_grad)
        return [*out, *waiting.values()]

    return table.with_ranks(map(row_with_probes, table.ranks))
