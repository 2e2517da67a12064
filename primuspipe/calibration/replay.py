"""What a recorded timeline ran: its placement, each rank's compute order, and that order as a table.

Run dumps and simulated timelines both record nodes with their times; replaying or comparing a run
needs the table behind it. A rank runs one compute node at a time, so the start order of its compute
nodes is exactly the order it ran them; communication is what ``add_communication`` derives from it.
"""

from __future__ import annotations

from primuspipe.algorithms import get_algorithm
from primuspipe.errors import TableFormatError, UnknownAlgorithmError
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.timeline import Timeline
from primuspipe.io.timeline_wiring import forwarded_from_rank_0, placement_of_events
from primuspipe.passes.communication import add_communication


def placement_of(timeline: Timeline, name: str | None = None) -> Placement:
    """Where the timeline's stages lived: the placement the timeline records in ``meta`` (the simulator and today's
    recorder write it), else the layout its algorithm is registered with (older run dumps and hand-written
    timelines record none) -- or, for an algorithm that chooses its layout per run (zb-auto, registered with
    ``"any"``), the layout the run's sends show. ``name`` (``--placement``) names the layout where neither says;
    one that contradicts what they say is refused (it drew a V run as interleaved without a word, and calibrated
    it into a deadlock diagnosis naming no flag)."""
    recorded = _recorded_placement(timeline)
    if name is not None:
        try:
            given = Placement.named(name, timeline.pp, timeline.vpp)
        except TableFormatError as exc:
            raise TableFormatError(f"--placement {name}: {exc} (the timeline is pp={timeline.pp} "
                                   f"vpp={timeline.vpp})") from None
        if recorded is not None and recorded != given:
            raise TableFormatError(
                f"--placement {name} contradicts the timeline, which ran {timeline.algorithm!r} on the "
                f"{recorded.name} layout; drop --placement (it names the layout of an unregistered algorithm)")
        return given
    if recorded is not None:
        return recorded
    try:
        get_algorithm(timeline.algorithm)
    except UnknownAlgorithmError:
        raise TableFormatError(
            f"the timeline's algorithm {timeline.algorithm!r} is not registered and the timeline records no "
            "placement, so its chunks cannot be mapped to stages; name the layout (--placement interleaved or v)"
        ) from None
    if timeline.vpp == 2 and timeline.pp > 1 and not forwarded_from_rank_0(timeline):
        raise TableFormatError(
            f"the timeline records no placement, its algorithm {timeline.algorithm!r} chooses one per run, and rank 0 "
            "sends no activation to show whether its 2 chunks per rank were a V or interleaved; name the layout "
            "(--placement interleaved or v)")
    return placement_of_events(timeline)


def _recorded_placement(timeline: Timeline) -> Placement | None:
    """The placement the timeline records, else its algorithm's registered layout; None where neither says (an
    unregistered algorithm, or one that chooses its layout per run)."""
    if "placement" in timeline.meta:
        return placement_of_events(timeline)  # checked against the timeline's shape
    try:
        layout = get_algorithm(timeline.algorithm).placement
    except UnknownAlgorithmError:
        return None
    return None if layout == "any" else Placement.named(layout, timeline.pp, timeline.vpp)


def compute_order(timeline: Timeline) -> dict[int, tuple[ScheduleNode, ...]]:
    """Per rank, its compute nodes in the order they ran (start order: a rank runs one compute node at
    a time, so this order is exact)."""
    return {rt.rank: tuple(e.node for e in sorted(rt.events, key=lambda e: e.start) if e.node.kind.is_compute)
            for rt in timeline.ranks}


def executed_table(timeline: Timeline, placement: Placement | None = None) -> ScheduleTable:
    """The compute-only table the timeline ran, from :func:`compute_order` (communication is what
    ``add_communication`` derives from it)."""
    placement = placement or placement_of(timeline)
    order = compute_order(timeline)
    if stray := sorted(r for r in order if not 0 <= r < timeline.pp):
        raise TableFormatError(f"the timeline has rank {stray[0]} but pp = {timeline.pp}")
    rows = [order.get(r, ()) for r in range(timeline.pp)]
    return ScheduleTable.build(placement, timeline.microbatches, rows, timeline.algorithm)


def run_table(timeline: Timeline, placement: Placement | None = None) -> ScheduleTable:
    """The full table the timeline ran: its compute order with the communication the runner adds
    (:func:`~primuspipe.passes.communication.add_communication`, the pass every built table went
    through), so each recorded SEND/RECV has its place in its rank's row."""
    return add_communication(executed_table(timeline, placement))
