"""The forward-only view of a table: what an evaluation step (``forward_only``) runs.

Keeps each rank's forwards and activation transfers in the table's order; an overlapped ``F+B`` node
counts as its ``F``. Dropping backward nodes and gradient transfers keeps each direction's sends and
receives in the same relative order, so pairing still holds; the view is validated anyway (structure,
order, pairing, deadlock: ``validate(view, complete=False)``, since completeness no longer applies), so
it carries its own proof when a runner gets it.

>>> from primuspipe.algorithms.build import build_schedule
>>> view = forward_only_view(build_schedule("1f1b", pp=2, microbatches=2))
>>> [str(n) for n in view.ranks[1]]
['RECV_F0.0<0', 'F0.0', 'RECV_F1.0<0', 'F1.0']
"""

from __future__ import annotations

import functools

from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import validate


@functools.lru_cache(maxsize=64)
def forward_only_view(table: ScheduleTable) -> ScheduleTable:
    """The table's forwards and activation transfers only (see the module docstring)."""
    forward = NodeKind.F
    view = table.with_ranks(
        tuple(ScheduleNode(*_forward_part(n)) if n.kind.spec.parts else n for n in row if _keeps(n, forward))
        for row in table.ranks)
    return validate(view, complete=False)


def _keeps(node: ScheduleNode, forward: NodeKind) -> bool:
    if node.kind.is_compute:
        return any(kind is forward for kind, _, _ in node.parts())
    return node.kind.carries is forward


def _forward_part(node: ScheduleNode):
    (part,) = [p for p in node.parts() if p.kind is NodeKind.F]
    return part
