"""Activations held per rank: in 1F1B-stage microbatch units and in bytes (the release rule).

Memory on a rank changes only at its own nodes, which run in table order, so the peaks are a property
of the table and the memory model, not of timing. Both figures come from the one activation counter
(:mod:`primuspipe.ir.activations`) with the model's ``w_retained_fraction``: a microbatch is held
from its F until its W, at the retained share between its B and its W — what the device holds.
"""

from __future__ import annotations

from primuspipe.ir.activations import peak_in_flight, running_levels
from primuspipe.ir.cost_model import MemoryCost
from primuspipe.ir.table import ScheduleTable


def peak_activations(table: ScheduleTable, memory: MemoryCost) -> tuple[list[float], list[float]]:
    """Per rank: (peak microbatch units, as :func:`~primuspipe.ir.activations.peak_in_flight` counts them;
    peak activation bytes, 0 when bytes are not modelled)."""
    retained = memory.w_retained_fraction
    units = peak_in_flight(table, retained)
    if not memory.models_bytes:
        return units, [0.0] * table.pp
    peaks = []
    for rank, row in enumerate(table.ranks):
        stages = table.placement.stages[rank]
        levels = running_levels(row, lambda chunk: memory.activation_bytes[stages[chunk]], retained)
        peaks.append(max(levels, default=0.0))
    return units, peaks
