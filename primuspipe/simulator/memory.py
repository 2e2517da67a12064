"""Activations held per rank: in 1F1B-stage microbatch units and in bytes (the release rule).

Memory on a rank changes at its own nodes. Compute nodes run in table order, so without host copies
the peaks are a property of the table and the memory model, not of timing. Host copies run beside the
compute (:mod:`primuspipe.simulator.host_copies`): an OFFLOAD frees the device only when its copy has
finished, a RELOAD takes the device from its copy's start. So the simulator feeds the one activation
counter (:mod:`primuspipe.ir.activations`) each rank's parts in *time* order -- compute parts at their
node's start, an offload at its copy's end, a reload at its copy's start -- with the model's
``w_retained_fraction`` and ``offload_fraction``: a microbatch is held from its F until its W, at the
retained share between its B and its W, less the offloaded share while it is on the host. The byte peaks
also count ``b_rise_fraction``: a split-backward B tops what it started with by what it has kept for its W
before it frees; and ``w_excess_fraction``: what W keeps beyond the retained share, held from B until W (the
microbatch units count microbatches, as the validator does, without either). The byte count's settings are
:meth:`~primuspipe.ir.cost_parts.MemoryCost.byte_count`, which the algorithms' byte budgets count with too.
"""

from __future__ import annotations

from collections.abc import Sequence

from primuspipe.ir.activations import levels_in_order, time_order
from primuspipe.ir.cost_model import MemoryCost
from primuspipe.ir.table import ScheduleTable


def peak_activations(table: ScheduleTable, memory: MemoryCost, starts: Sequence[Sequence[float]],
                     ends: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Per rank: (peak microbatch units, 1F1B-stage microbatches as
    :func:`~primuspipe.ir.activations.peak_in_flight` counts them; peak activation bytes, 0 when bytes
    are not modelled), with the nodes' simulated ``starts`` and ``ends``."""
    retained, offloaded = memory.w_retained_fraction, memory.offload_fraction
    units, peaks = [], []
    for rank, row in enumerate(table.ranks):
        order = time_order(row, starts[rank], ends[rank])
        levels = levels_in_order(row, order, retained=retained, offloaded=offloaded)
        units.append(max(levels, default=0.0) / table.vpp)
        if memory.models_bytes:
            count = memory.byte_count(table.placement.stages[rank])
            peaks.append(max(levels_in_order(row, order, **count), default=0.0))
        else:
            peaks.append(0.0)
    return units, peaks
