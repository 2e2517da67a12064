"""Lowering overlapped nodes: each ``F+B`` (FB) node becomes its F, then its B.

For runners that cannot overlap two microbatches, and for comparing an overlapped schedule with the
same order run plainly. Takes and returns a compute-only table (communication is derived afterwards).

>>> from primuspipe.ir.node import FB
>>> from primuspipe.ir.placement import Placement
>>> t = ScheduleTable.build(Placement.vshape(1), 1, [[FB(0, 0, 0, 1)]])
>>> [str(n) for n in lower_overlap(t).ranks[0]]
['F0.0', 'B0.1']
"""

from __future__ import annotations

from primuspipe.errors import TableFormatError
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable


def lower_overlap(table: ScheduleTable) -> ScheduleTable:
    """The same schedule with each overlapped node run as its parts, in order."""
    if table.has_communication:
        raise TableFormatError("lower_overlap takes a compute-only table; pass table.compute_only() and add "
                               "communication afterwards")
    return table.with_ranks(
        [ScheduleNode(*part) for node in row for part in node.parts()] if any(n.kind.spec.parts for n in row) else row
        for row in table.ranks
    )
