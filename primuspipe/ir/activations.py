"""The one activation counter: how much a rank holds after each node of its row.

Every kind's effect is data (:attr:`~primuspipe.ir.kinds.KindSpec.activation`): F takes a
microbatch's activations for its stage, B frees all but the share ``retained`` that a deferred W still
needs (the inputs of its GEMMs), W frees that share, BW frees everything. The validator's memory rule,
``peak_in_flight``, the simulator's bytes, the list scheduler, the building-block check and the MILP
all count with :func:`running_levels`, so "what a rank holds" means one thing everywhere.

Units: ``weight(stage)`` is what one microbatch of a stage holds — 1 chunk activation by default, bytes
in the simulator. An overlapped node counts its forward before its backward frees, so the pair holds
both at once.

>>> from primuspipe.ir.node import F, B, W
>>> running_levels([F(0), F(1), B(0), W(0)], chunk_weight=lambda c: 1.0, retained=0.25)
[1.0, 2.0, 2.0, 1.25]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode

if TYPE_CHECKING:
    from primuspipe.ir.table import ScheduleTable


def running_levels(row: Iterable[ScheduleNode], chunk_weight: Callable[[int], float] = lambda chunk: 1.0,
                   retained: float = 0.0) -> list[float]:
    """Per node of one rank's row: the most held while it runs (after its forward parts, before the
    backward parts of the same node free anything, i.e. the level right after each part, maxed)."""
    held, levels = 0.0, []
    for node in row:
        top = held
        for kind, _, chunk in node.parts():
            held += kind.spec.activation_delta(retained) * chunk_weight(chunk)
            top = max(top, held)
        levels.append(top)
    return levels


def peak_level(kinds: Iterable[tuple[NodeKind, int]], chunk_weight: Callable[[int], float] = lambda chunk: 1.0,
               retained: float = 0.0) -> float:
    """The most held over a sequence of ``(kind, chunk)`` compute parts (e.g. a constructed F/B order)."""
    held = peak = 0.0
    for kind, chunk in kinds:
        held += kind.spec.activation_delta(retained) * chunk_weight(chunk)
        peak = max(peak, held)
    return peak


def peak_in_flight(table: ScheduleTable, retained: float = 0.0) -> list[float]:
    """Per rank, the most activations held at once in 1F1B-stage microbatches (a chunk's are ``1/vpp``
    of one); ``retained = 0`` counts a microbatch from its F until its B."""
    return [max(running_levels(row, retained=retained), default=0.0) / table.vpp for row in table.ranks]
