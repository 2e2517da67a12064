"""The offload pass: OFFLOAD / RELOAD nodes that bring a table's activations under a memory limit.

A V-shape (or any split-backward table) keeps some microbatches' activations on the device for a long
stretch between their F and their B, while other microbatches run. Moving them to host memory for that
stretch lowers the peak at the price of host-link traffic, which overlaps compute on the rank's copy
streams (docs/offload.md). The pass works per rank, greedily, on the compute order:

1. count what the rank holds while each node runs (the one activation counter,
   :mod:`primuspipe.ir.activations`, in the validator's units: 1F1B-stage microbatches), in time order
   on the rank's own clock -- compute back to back, copies queued on their stream -- so an offload
   frees the device only once its copy has finished, as the simulator counts it;
2. at the peak node, among the (chunk, microbatch) pairs held across it -- F before it, backward after
   it -- take the one with the longest F-to-B gap in compute time whose gap leaves room for both
   copies: the compute between its F and the peak covers the offload copy, and the compute between
   its RELOAD and its backward covers the reload copy (times from the cost model's ``host_link``);
3. put its OFFLOAD right after its F and its RELOAD as late as the reload copy allows (the latest place
   with at least the copy's time of compute before the backward), so the activations return just in
   time and no earlier;
4. repeat until the peak meets the limit; if no pair can be moved, refuse with the rank, the peak node
   and the fix.

The result validates (:func:`~primuspipe.passes.validation.check_offload`) and computes exactly what the
input computes; only where activations live changes. The simulator times the copies and the memory
curve; a too-slow host link shows as backwards waiting for their reloads.

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.ir.activations import peak_in_flight
>>> from primuspipe.ir.cost_model import CostModel
>>> table = build_schedule("v-half", pp=4, microbatches=8)
>>> peak_in_flight(table, retained=1.0)
[3.0, 3.0, 3.0, 3.0]
>>> cost = CostModel.per_stage(8, 1, 1, 1)
>>> lean = offload_activations(table, cost, memory_limit=2.0, retained=1.0)
>>> peak_in_flight(lean, retained=1.0)
[2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

from primuspipe.errors import ConfigError
from primuspipe.ir.activations import timed_levels
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication

_EPS = 1e-9


class OffloadError(ConfigError):
    """The offload pass cannot bring a rank's activations under the memory limit."""


def offload_activations(table: ScheduleTable, cost: CostModel, *, memory_limit: float,
                        retained: float | None = None) -> ScheduleTable:
    """``table`` with OFFLOAD/RELOAD nodes so that no rank holds more than ``memory_limit`` microbatches
    of 1F1B-stage activations (the unit of ``--memory-limit`` and ``validate --max-in-flight``), each
    offload moving the cost model's ``memory.offload_fraction`` of a chunk's activations.

    ``retained`` (default: the cost model's ``w_retained_fraction``) is the share B keeps for W. A table
    with communication gets it rebuilt around the new nodes. A table that already meets the limit comes
    back unchanged."""
    if any(n.kind.on_host_stream for row in table.ranks for n in row):
        raise OffloadError(f"the {table.algorithm} table already has OFFLOAD/RELOAD nodes; run the offload pass on "
                           "the table without them")
    if memory_limit <= 0:
        raise OffloadError(f"the memory limit must be > 0 microbatches, got {memory_limit}")
    if cost.num_stages != table.num_stages:
        cost = cost.for_shape(table.pp, table.vpp)
    retained = cost.memory.w_retained_fraction if retained is None else retained
    compute = table.compute_only()
    rows = [_offload_row(compute, cost, rank, retained, memory_limit * table.vpp) for rank in range(table.pp)]
    if all(len(new) == len(old) for new, old in zip(rows, compute.ranks)):
        return table
    out = compute.with_ranks(rows)
    return add_communication(out) if table.has_communication else out


def _offload_row(table: ScheduleTable, cost: CostModel, rank: int, retained: float, cap: float
                 ) -> list[ScheduleNode]:
    """One rank's compute row with offloads until it holds at most ``cap`` chunk activations."""
    placement, offloaded = table.placement, cost.memory.offload_fraction
    row = list(table.ranks[rank])
    while True:
        times = [cost.node_time(placement, rank, n) for n in row]
        starts, ends = _own_clock(table, cost, rank, row, times)
        levels = timed_levels(row, starts, ends, retained=retained, offloaded=offloaded)
        peak = max(range(len(row)), key=levels.__getitem__, default=0)
        if not row or levels[peak] <= cap + _EPS:
            return row
        best = None
        for chunk, mb, f, b in _held_across(row, peak):
            copy = cost.copy_time(placement.stage(rank, chunk))
            if ends[f] + copy > starts[peak] + _EPS:
                continue  # the offload copy could not finish before the peak
            r = _reload_index(times, peak + 1, b, copy)
            if r is None:
                continue
            gap = sum(times[f + 1:b])
            if best is None or gap > best[0]:
                best = (gap, chunk, mb, f, r)
        if best is None or offloaded <= 0:
            raise OffloadError(
                f"rank {rank}: offloading cannot bring the activations under {cap / table.vpp:g} microbatches: node "
                f"{peak} ({row[peak]}) holds {levels[peak] / table.vpp:g} and no microbatch held across it has an "
                "F-to-B gap long enough for its host copies; fix: raise the memory limit, give the cost model a "
                "faster host_link, or pick a schedule with fewer microbatches in flight")
        _, chunk, mb, f, r = best
        row.insert(r, ScheduleNode(NodeKind.RELOAD, mb, chunk))
        row.insert(f + 1, ScheduleNode(NodeKind.OFFLOAD, mb, chunk))


def _own_clock(table: ScheduleTable, cost: CostModel, rank: int, row: list[ScheduleNode], times: list[float]
               ) -> tuple[list[float], list[float]]:
    """Start and end of each node on the rank's own clock: compute back to back (no waits for other
    ranks, which only give copies more time), each copy queued on its direction's stream."""
    clock, free = 0.0, {True: 0.0, False: 0.0}
    starts, ends = [], []
    for node, time in zip(row, times):
        if node.kind.on_host_stream:
            to_host = node.kind.spec.offload < 0
            start = max(clock, free[to_host])
            free[to_host] = end = start + cost.copy_time(table.placement.stage(rank, node.chunk))
        else:
            start, end = clock, clock + time
            clock = end
        starts.append(start)
        ends.append(end)
    return starts, ends


def _held_across(row: list[ScheduleNode], peak: int) -> list[tuple[int, int, int, int]]:
    """``(chunk, microbatch, F index, backward index)`` of the activations held at ``peak``: F before it,
    their first backward (B or BW) after it, not offloaded yet."""
    forward: dict[tuple[int, int], int] = {}
    backward: dict[tuple[int, int], int] = {}
    moved = set()
    for i, node in enumerate(row):
        for kind, mb, chunk in node.parts():
            if kind is NodeKind.F:
                forward[(chunk, mb)] = i
            elif NodeKind.B in kind.completes:
                backward.setdefault((chunk, mb), i)
            elif kind.on_host_stream:
                moved.add((chunk, mb))
    return [(c, mb, f, backward[(c, mb)]) for (c, mb), f in forward.items()
            if f < peak and backward.get((c, mb), -1) > peak and (c, mb) not in moved]


def _reload_index(times: list[float], first: int, backward: int, copy: float) -> int | None:
    """The latest index in ``[first, backward]`` with at least ``copy`` of compute before ``backward``
    (where the RELOAD goes), or None if even ``first`` leaves too little."""
    covered = 0.0
    for r in range(backward, first - 1, -1):
        if covered + _EPS >= copy:
            return r
        if r > first:
            covered += times[r - 1]
    return None
