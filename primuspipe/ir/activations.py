"""The one activation counter: how much a rank holds after each node of its row.

A microbatch is *in flight* on a rank from its F until its W. Every kind's effect is data
(:attr:`~primuspipe.ir.kinds.KindSpec.activation`): F takes a microbatch's activations for its stage,
B frees all but the share ``retained`` that the deferred W still needs (the inputs of its GEMMs), W
frees that share, BW frees everything. The validator's memory rule, ``peak_in_flight``, the
simulator's peaks (units and bytes), the list scheduler, the building blocks and the MILP all count
with these effects, so "what a rank holds" means one thing everywhere: what the device holds.

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

W_RETAINED_FRACTION = 32 / 34
"""Default share of a microbatch's activations that B keeps alive for its deferred W.

Per transformer layer, the Zero Bubble paper (Qi et al., ICLR 2024, Table 1) gives B's activation
memory as ``M_B = sb(34h + 5as)`` and W's as ``M_W = 32sbh``: W needs the inputs of every GEMM. The
``5as`` term is the attention score matrices, which flash attention never stores, so with it (every
current LLM training stack) W keeps ``32 / 34`` (94 %) of what B needed. Without flash attention the
share is much smaller (``32h / (34h + 5as)``: about 0.17 at a = 32, s = 4096, h = 4096); a cost model
says so with ``memory.w_retained_fraction``.
"""


def running_levels(row: Iterable[ScheduleNode], chunk_weight: Callable[[int], float] = lambda chunk: 1.0,
                   retained: float = W_RETAINED_FRACTION) -> list[float]:
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
               retained: float = W_RETAINED_FRACTION) -> float:
    """The most held over a sequence of ``(kind, chunk)`` compute parts (e.g. a constructed order)."""
    held = peak = 0.0
    for kind, chunk in kinds:
        held += kind.spec.activation_delta(retained) * chunk_weight(chunk)
        peak = max(peak, held)
    return peak


def peak_in_flight(table: ScheduleTable, retained: float = W_RETAINED_FRACTION) -> list[float]:
    """Per rank, the most activations held at once, in microbatches of one 1F1B stage (a chunk's are
    ``1/vpp`` of one): each microbatch counted from its F until its W, at ``retained`` of its size
    between its B and its W. ``retained = 1`` counts whole microbatches until W (Primus's count);
    ``retained = 0`` from F until B (the zero-bubble papers' count)."""
    return [max(running_levels(row, retained=retained), default=0.0) / table.vpp for row in table.ranks]
