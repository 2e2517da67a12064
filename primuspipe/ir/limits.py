"""How large a schedule primuspipe builds: one bound, checked before anything of a shape is built -- a table's
nodes (:class:`~primuspipe.ir.table.ScheduleTable`), a placement's stages (:class:`~primuspipe.ir.placement.Placement`:
a Primus text naming chunk 99,999,999 built 100 million of them) and a cost model's per-stage values."""

from __future__ import annotations

from primuspipe.errors import ScheduleShapeError

MAX_NODES = 4_000_000
"""The largest table primuspipe builds, reads or checks: about a minute of work for each of building,
adding communication and validating (pp=64, vpp=2, m=512 is 391,168 nodes)."""
NODES_PER_STEP = 7
"""At most F, B, W and four transfers per (stage, microbatch): the bound a shape's size is judged by."""
MOST_NODES_PER_STEP = NODES_PER_STEP + 2
"""And an OFFLOAD and a RELOAD: no valid table holds more per (stage, microbatch), so rows that do repeat nodes
(a plug-in's three million copies of one F took the validator half a minute to name)."""


def check_shape(pp: int, vpp: int, microbatches: int) -> None:
    """Refuse a shape whose full table could exceed :data:`MAX_NODES`, before anything is built."""
    nodes = pp * vpp * microbatches * NODES_PER_STEP
    if nodes > MAX_NODES:
        raise ScheduleShapeError(
            f"pp={pp:,} x vpp={vpp:,} x {microbatches:,} microbatches makes a table of up to {nodes:,} nodes, more "
            f"than the {MAX_NODES:,} primuspipe builds and checks in reasonable time; use fewer microbatches, chunks "
            "or ranks")
