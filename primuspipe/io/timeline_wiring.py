"""A timeline's events on the table they ran: where its stages lived, and which send met which receive.

A timeline names nodes, not transfers: a microbatch's chunks cross one link once each, and only the stages tell
which of them a send or a receive moved. So the events are matched by the table's wiring over the placement the
timeline ran -- one rule, apart from the document (:mod:`~primuspipe.io.timeline`) because it needs the table
model, and shared by the merge's clock check (:mod:`~primuspipe.io.run_dumps`), calibration's walk
(:mod:`~primuspipe.calibration.walk`) and its replay (:mod:`~primuspipe.calibration.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence

from primuspipe.errors import TableFormatError
from primuspipe.io.timeline import TimedNode, Timeline
from primuspipe.ir.dataflow import Wiring
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.placement import Placement


def timed_transfers(rows: Sequence[Sequence[TimedNode | None]], wiring: Wiring
                    ) -> tuple[dict[int, TimedNode], dict[int, TimedNode]]:
    """Each transfer's send event and receive event, by the wiring's transfer key: ``rows[rank][i]`` is the event
    of the wiring's node ``i`` of ``rank`` (None where it was not recorded). The one way a timeline's sends meet
    their receives, for the clock check and calibration's walk alike."""
    sent: dict[int, TimedNode] = {}
    received: dict[int, TimedNode] = {}
    for row, moves in zip(rows, wiring.moves):
        for e, key in zip(row, moves):
            if key >= 0 and e is not None:
                (sent if e.node.kind.is_send else received)[key] = e
    return sent, received


def placement_of_events(timeline: Timeline) -> Placement:
    """Where the timeline's stages lived, as far as the timeline itself says: the placement it records (the
    recorder and the simulator write it; a merge keeps it), else the built-in layout its communication shows
    (:meth:`~primuspipe.ir.placement.Placement.shown_by`: dumps of older recorders record none). Not the layout
    the timeline's algorithm is registered with: that is the registry's to say, above this module
    (:func:`~primuspipe.calibration.replay.placement_of`)."""
    if "placement" not in timeline.meta:
        return Placement.shown_by(timeline.pp, timeline.vpp, forwarded_from_rank_0(timeline))
    placement = Placement.from_dict(timeline.meta["placement"], "a timeline's meta.placement")
    if (placement.pp, placement.vpp) != (timeline.pp, timeline.vpp):
        raise TableFormatError(f"the timeline is pp={timeline.pp} vpp={timeline.vpp} but its meta.placement is "
                               f"pp={placement.pp} vpp={placement.vpp}; the placement belongs to another run")
    return placement


def forwarded_from_rank_0(timeline: Timeline) -> list[int]:
    """The chunks rank 0 sends activations from in ``timeline``: what shows a layout the timeline does not record
    (:meth:`~primuspipe.ir.placement.Placement.shown_by`); none where it times no such send."""
    rank_0 = next((r.events for r in timeline.ranks if r.rank == 0), ())
    return [e.node.chunk for e in rank_0 if e.node.kind.is_send and e.node.kind.carries is NodeKind.F]

