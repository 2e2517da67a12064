"""Activations held per rank: in 1F1B-stage microbatch units and in bytes (the release rule).

Memory on a rank changes only at its own nodes, which run in table order, so the peaks are a property
of the table and the byte counts, not of timing. A node's forwards are counted before its backwards
release anything (an FB pair holds both at once). The unit count follows
:func:`primuspipe.validation.peak_in_flight` exactly: a chunk's activation is 1/vpp of a unit, held from
F until B or BW.
"""

from __future__ import annotations

from primuspipe.node import NodeKind
from primuspipe.simulator.cost_model import MemoryCost
from primuspipe.table import ScheduleTable


def peak_activations(table: ScheduleTable, memory: MemoryCost | None) -> tuple[list[float], list[float]]:
    """Per rank: (peak microbatch units, peak activation bytes; 0 when memory is not modelled)."""
    act = memory.activation_bytes if memory is not None else (0.0,) * table.num_stages
    keep = memory.w_retained_fraction if memory is not None else 0.0
    # per backward kind: (chunk activations ended, share of the bytes released)
    release = {NodeKind.B: (1, 1.0 - keep), NodeKind.W: (0, keep), NodeKind.BW: (1, 1.0)}
    units, peaks = [], []
    for rank, row in enumerate(table.ranks):
        stages = table.placement.stages[rank]
        chunks = held = peak = 0.0
        peak_chunks = 0
        for node in row:
            kind = node.kind
            if kind is NodeKind.F:
                chunks += 1
                held += act[stages[node.chunk]]
            elif kind is NodeKind.FB:
                (_, _, f_chunk), (_, _, b_chunk) = node.parts()
                chunks += 1
                held += act[stages[f_chunk]]
                peak_chunks, peak = max(peak_chunks, chunks), max(peak, held)
                chunks -= 1
                held -= release[NodeKind.B][1] * act[stages[b_chunk]]
                continue
            if chunks > peak_chunks:
                peak_chunks = chunks
            if held > peak:
                peak = held
            if kind in release:
                ended, share = release[kind]
                chunks -= ended
                held -= share * act[stages[node.chunk]]
        units.append(peak_chunks / table.vpp)
        peaks.append(peak)
    return units, peaks
