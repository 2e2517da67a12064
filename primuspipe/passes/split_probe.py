"""A calibration probe for fused-backward schedules: a few ``BW`` nodes run as ``B`` then ``W``.

A run of 1F1B (or interleaved 1F1B) times F and the fused backward BW, but not what B and W cost when a
split-backward schedule (ZB-H1, ZBV, V-half, ...) runs them as two nodes: their shares of BW and the
extra time the split itself takes (the deferred weight GEMMs run later, on inputs no longer in cache,
through their own autograd call). Without that, a cost model calibrated from a 1F1B run halves BW and
predicts split schedules too fast. This pass splits the backward of ``count`` microbatches of every
chunk into B and a W after the rank's next forward -- the same order otherwise, the same gradients (W adds exactly
what BW's weight GEMMs add) -- so a dump of that run gives ``primuspipe calibrate`` real B and W times
next to BW (docs/simulator.md, "Calibration").

Takes and returns a compute-only table (add communication afterwards), like the other lowering passes.

>>> from primuspipe.algorithms.build import build_schedule
>>> probed = split_backward_probe(build_schedule("1f1b", pp=2, microbatches=5).compute_only())
>>> " ".join(map(str, probed.ranks[0]))
'F0.0 F1.0 BW0.0 F2.0 BW1.0 F3.0 B2.0 F4.0 W2.0 BW3.0 BW4.0'
"""

from __future__ import annotations

from primuspipe.errors import ConfigError, TableFormatError
from primuspipe.ir.kinds import NodeKind, step_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable


def split_backward_probe(table: ScheduleTable, count: int = 1) -> ScheduleTable:
    """``table`` with the BW of ``count`` microbatches from the middle of the step, on every chunk, run as
    B, then the rank's next forward, then W -- where a split-backward schedule's steady state puts a W
    (ZB-H1: after the next forward), so the probe pays what deferring it costs: inputs no longer in
    cache, more activations alive. Where a backward comes next, W comes right after B, so every weight
    still sums its microbatches' gradients in the table's order (the same gradients, bitwise)."""
    if table.has_communication:
        raise TableFormatError("split_backward_probe takes a compute-only table; pass table.compute_only() and add "
                               "communication afterwards")
    if not 1 <= count <= table.microbatches:
        raise ConfigError(f"split probe: count must be between 1 and the {table.microbatches} microbatches, "
                          f"got {count}")
    first = (table.microbatches - count) // 2
    probed = range(first, first + count)

    def row_with_probes(row: tuple[ScheduleNode, ...]) -> list[ScheduleNode]:
        out: list[ScheduleNode] = []
        waiting: ScheduleNode | None = None  # a probe's W, placed after the next node if that is a forward
        for node in row:
            if waiting is not None and node.kind is not NodeKind.F:  # a later backward must not add its
                out.append(waiting)                                  # weight gradients first
                waiting = None
            split = node.kind is NodeKind.BW and node.microbatch in probed
            backward, weight_grad = (ScheduleNode(step_kind(step), node.microbatch, node.chunk)
                                     for step in node.kind.completes) if split else (node, None)
            out.append(backward)
            if waiting is not None:
                out.append(waiting)
            waiting = weight_grad
        return out if waiting is None else [*out, waiting]

    return table.with_ranks(map(row_with_probes, table.ranks))
