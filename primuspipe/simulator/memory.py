"""Activations held per rank: in 1F1B-stage microbatch units and in bytes (the release rule).

Memory on a rank changes only at its own nodes, which run in table order, so the peaks are a property
of the table and the byte counts, not of timing. A node's forwards are counted before its backwards
release anything (an FB pair holds both at once). The unit count is
:func:`primuspipe.passes.validation.peak_in_flight`'s: a chunk's activation is 1/vpp of a unit, held from F
until B or BW; the byte count follows the release rule, B keeping the share W still needs.
"""

from __future__ import annotations

from primuspipe.ir.node import NodeKind
from primuspipe.simulator.cost_model import MemoryCost
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import peak_in_flight


def peak_activations(table: ScheduleTable, memory: MemoryCost | None) -> tuple[list[float], list[float]]:
    """Per rank: (peak microbatch units, as :func:`~primuspipe.passes.validation.peak_in_flight` counts them;
    peak activation bytes, 0 when memory is not modelled)."""
    units = peak_in_flight(table)
    if memory is None:
        return units, [0.0] * table.pp
    act, keep = memory.activation_bytes, memory.w_retained_fraction
    # share of a stage's activation bytes each kind adds (+) or releases (-)
    share = {NodeKind.F: 1.0, NodeKind.B: keep - 1.0, NodeKind.W: -keep, NodeKind.BW: -1.0}
    peaks = []
    for rank, row in enumerate(table.ranks):
        stages = table.placement.stages[rank]
        held = peak = 0.0
        for node in row:
            for kind, _, chunk in node.parts():  # an FB's forward counts before its backward releases
                held += share[kind] * act[stages[chunk]]
                peak = max(peak, held)
        peaks.append(peak)
    return units, peaks
