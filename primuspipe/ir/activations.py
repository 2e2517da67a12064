"""The one activation counter: how much a rank holds after each node of its row.

A microbatch is *in flight* on a rank from its F until its W. Every kind's effect is data
(:attr:`~primuspipe.ir.kinds.KindSpec.activation`): F takes a microbatch's activations for its stage,
B frees all but the share ``retained`` that the deferred W still needs (the inputs of its GEMMs), W
frees that share, BW frees everything; while a B runs, the level first rises by the share ``rise``
(what it keeps for W before it frees: :attr:`~primuspipe.ir.kinds.KindSpec.rise`, the simulator's byte
peaks). The validator's memory rule, ``peak_in_flight``, the simulator's peaks (units and bytes), the list
scheduler, the building blocks and the MILP all count with these effects, so "what a rank holds" means
one thing everywhere: what the device holds.

Offload: an OFFLOAD node moves the share ``offloaded`` (the cost model's
``memory.offload_fraction``; 1 = all of them) of a microbatch's activations on a chunk to host memory,
so they are not held from the OFFLOAD until its RELOAD brings them back (docs/offload.md). In table
order (:func:`running_levels`) the drop is counted at the OFFLOAD node. A copy takes time, though: with
node times, :func:`timed_levels` counts the same effects in time order, an offload freeing the device
once its copy has finished and a reload taking it from its copy's start (the simulator's memory, and
the offload pass's estimate).

Units: ``weight(stage)`` is what one microbatch of a stage holds — 1 chunk activation by default, bytes
in the simulator. An overlapped node counts its forward before its backward frees, so the pair holds
both at once.

>>> from primuspipe.ir.node import F, B, W
>>> running_levels([F(0), F(1), B(0), W(0)], chunk_weight=lambda c: 1.0, retained=0.25)
[1.0, 2.0, 2.0, 1.25]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from primuspipe import strict
from primuspipe.errors import ConfigError
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


OFFLOAD_FRACTION = 1.0
"""Default share of a microbatch's activations on a chunk that an OFFLOAD moves: all of them (the
runner offloads every tensor autograd saves in the chunk's forward unless told which ops)."""


class _Effects(dict):
    """(kind, chunk) -> one such compute part's (level change, rise above the level it starts from) under one
    count's settings: a row repeats a few of them thousands of times, so each is worked out once per count."""

    def __init__(self, chunk_weight: Callable[[int], float], retained: float, offloaded: float, rise: float):
        super().__init__()
        self.chunk_weight, self.retained, self.offloaded, self.rise = chunk_weight, retained, offloaded, rise
        self._nodes: dict[tuple, tuple[tuple[float, float], ...]] = {}

    def of(self, node: ScheduleNode) -> tuple[tuple[float, float], ...]:
        """The effects of ``node``'s parts, in order; they depend on its kind and chunks, not its microbatch."""
        key = (node.kind, node.chunk, node.pair)
        if (effects := self._nodes.get(key)) is None:
            effects = self._nodes[key] = tuple(self[kind, chunk] for kind, _, chunk in node.parts())
        return effects

    def __missing__(self, key: tuple[NodeKind, int]) -> tuple[float, float]:
        kind, chunk = key
        weight = self.chunk_weight(chunk)
        effect = self[key] = (kind.spec.activation_delta(self.retained, self.offloaded) * weight,
                              kind.spec.rise * self.rise * weight)
        return effect


def _step(effect: tuple[float, float], held: float) -> tuple[float, float]:
    """One compute part of ``effect`` (:class:`_Effects`) applied to ``held``: (the level after it, the most
    held while it ran -- a part that rises (B) first peaks above where it started)."""
    change, rise = effect
    after = held + change
    return after, max(held + rise, after)


def _run_parts(node: ScheduleNode, held: float, effects: _Effects) -> tuple[float, float]:
    """``node``'s parts applied to ``held``: (the level after them, the most held while they ran)."""
    top = held
    for effect in effects.of(node):
        held, part_top = _step(effect, held)
        top = max(top, part_top)
    return held, top


def running_levels(row: Iterable[ScheduleNode], chunk_weight: Callable[[int], float] = lambda chunk: 1.0,
                   retained: float = W_RETAINED_FRACTION, offloaded: float = OFFLOAD_FRACTION,
                   rise: float = 0.0) -> list[float]:
    """Per node of one rank's row: the most held while it runs (after its forward parts, before the
    backward parts of the same node free anything, i.e. the level right after each part, maxed, and a
    B's ``rise``: :func:`_run_parts`)."""
    held, levels, effects = 0.0, [], _Effects(chunk_weight, retained, offloaded, rise)
    for node in row:
        held, top = _run_parts(node, held, effects)
        levels.append(top)
    return levels


def timed_levels(row: Sequence[ScheduleNode], starts: Sequence[float], ends: Sequence[float],
                 chunk_weight: Callable[[int], float] = lambda chunk: 1.0, retained: float = W_RETAINED_FRACTION,
                 offloaded: float = OFFLOAD_FRACTION, rise: float = 0.0) -> list[float]:
    """Per node of one rank's row, with the nodes' ``starts`` and ``ends``: the most held while it runs,
    its effects applied in time order (:func:`time_order`). Without host copies this is
    :func:`running_levels` (a rank's compute starts are in table order)."""
    return levels_in_order(row, time_order(row, starts, ends), chunk_weight, retained, offloaded, rise)


def time_order(row: Sequence[ScheduleNode], starts: Sequence[float], ends: Sequence[float]) -> list[int]:
    """The indices of ``row``'s nodes in the order their effects apply, with the nodes' ``starts`` and
    ``ends``: a node that frees on a host copy (OFFLOAD) at its end, every other node at its start; at one
    moment a finished offload first, then table order. One order serves every count of the row (units,
    bytes)."""
    keyed = []
    for i, node in enumerate(row):
        late = node.kind.spec.offload < 0
        keyed.append((ends[i] if late else starts[i], not late, i))
    return [i for _, _, i in sorted(keyed)]


def levels_in_order(row: Sequence[ScheduleNode], order: Iterable[int],
                    chunk_weight: Callable[[int], float] = lambda chunk: 1.0, retained: float = W_RETAINED_FRACTION,
                    offloaded: float = OFFLOAD_FRACTION, rise: float = 0.0) -> list[float]:
    """Per node of one rank's row: the most held while it runs, its effects applied in ``order`` (indices
    into ``row``, e.g. :func:`time_order`)."""
    held, levels, effects = 0.0, [0.0] * len(row), _Effects(chunk_weight, retained, offloaded, rise)
    for i in order:
        held, levels[i] = _run_parts(row[i], held, effects)
    return levels


def peak_level(kinds: Iterable[tuple[NodeKind, int]], chunk_weight: Callable[[int], float] = lambda chunk: 1.0,
               retained: float = W_RETAINED_FRACTION, offloaded: float = OFFLOAD_FRACTION, rise: float = 0.0) -> float:
    """The most held over a sequence of ``(kind, chunk)`` compute parts (e.g. a constructed order, or
    a rank's events in time order), a B's ``rise`` included."""
    held = peak = 0.0
    effects = _Effects(chunk_weight, retained, offloaded, rise)
    for kind, chunk in kinds:
        held, top = _step(effects[kind, chunk], held)
        peak = max(peak, top)
    return peak


@strict.arguments()
def peak_in_flight(table: ScheduleTable, retained: float = W_RETAINED_FRACTION,
                   offloaded: float = OFFLOAD_FRACTION) -> list[float]:
    """Per rank, the most activations held at once, in microbatches of one 1F1B stage (a chunk's are
    ``1/vpp`` of one): each microbatch counted from its F until its W, at ``retained`` of its size
    between its B and its W. ``retained = 1`` counts whole microbatches until W (Primus's count);
    ``retained = 0`` from F until B (the zero-bubble papers' count)."""
    from primuspipe.ir.table import ScheduleTable  # the table module imports this one

    strict.instance(table, ScheduleTable, "peak_in_flight's table", error=ConfigError)
    retained, offloaded = (strict.number(share, f"peak_in_flight's {name}", minimum=0, maximum=1)  # 2.5 was counted
                           for name, share in (("retained", retained), ("offloaded", offloaded)))
    return [max(running_levels(row, retained=retained, offloaded=offloaded), default=0.0) / table.vpp
            for row in table.ranks]
