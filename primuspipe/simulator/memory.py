"""Activations held per rank: in 1F1B-stage microbatch units and in bytes (the release rule).

Memory on a rank changes only at its own nodes, which run in table order, so the peaks are a property
of the table and the byte counts, not of timing. Both figures come from the one activation counter
(:mod:`primuspipe.ir.activations`): the unit count holds a chunk's activation (1/vpp of a unit) from F
until B or BW; the byte count follows the release rule, B keeping the share W still needs.
"""

from __future__ import annotations

from primuspipe.ir.activations import peak_in_flight, running_levels
from primuspipe.ir.table import ScheduleTable
from primuspipe.ir.cost_model import MemoryCost


def peak_activations(table: ScheduleTable, memory: MemoryCost | None) -> tuple[list[float], list[float]]:
    """Per rank: (peak microbatch units, as :func:`~primuspipe.ir.activations.peak_in_flight` counts them;
    peak activation bytes, 0 when memory is not modelled)."""
    units = peak_in_flight(table)
    if memory is None:
        return units, [0.0] * table.pp
    peaks = []
    for rank, row in enumerate(table.ranks):
        stages = table.placement.stages[rank]
        levels = running_levels(row, lambda chunk: memory.activation_bytes[stages[chunk]], memory.w_retained_fraction)
        peaks.append(max(levels, default=0.0))
    return units, peaks
