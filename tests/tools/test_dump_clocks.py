"""Merging rank dumps refuses ranks whose clocks disagree: a receive that ended more than a rank's whole step before
its send began. A send meets its receive by the table's wiring, so the check names the transfer it caught, stages
and all; these timelines are small enough to read, and the interleaved one moves microbatch 0's activation from
rank 0 to rank 1 twice (from chunk 0 and from chunk 1), where only the stages tell the two apart."""

from dataclasses import replace

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import TableFormatError
from primuspipe.io.run_dumps import merge_rank_timelines
from primuspipe.io.timeline import RankTimeline, TimedNode, Timeline
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement


def _part(rank: int, events: list[tuple[str, float, float]], placement: Placement | None) -> Timeline:
    """One rank's dump of a forward-only interleaved step (pp 2, vpp 2, one microbatch), its clock at 1000 s."""
    meta = {"t0_unix": 1000.0, "run_id": "r"} | ({} if placement is None else {"placement": placement.to_dict()})
    timed = tuple(TimedNode(ScheduleNode.parse(node), start, end) for node, start, end in events)
    return Timeline("run", "interleaved-1f1b", 2, 2, 1, (RankTimeline(rank, timed),), meta=meta)


RANK_0 = [("F0.0", 10.0, 11.0), ("SEND_F0.0>1", 11.0, 11.1), ("RECV_F0.1<1", 11.1, 11.7), ("F0.1", 11.7, 13.0),
          ("SEND_F0.1>1", 13.1, 13.2)]
"""Stage 0 (chunk 0) sends to stage 1 at 11.0 s, stage 2 (chunk 1) to stage 3 at 13.1 s; span 3.2 s."""
IN_ORDER = [("RECV_F0.0<0", 9.0, 10.5), ("F0.0", 10.5, 11.5), ("SEND_F0.0>0", 11.5, 11.6), ("RECV_F0.1<0", 11.6, 13.3),
            ("F0.1", 13.3, 14.0)]
"""Rank 1 as it ran: each receive ends after its send began."""
CHUNK_1_EARLY = [("RECV_F0.1<0", 8.9, 9.0), ("RECV_F0.0<0", 9.0, 10.5), ("F0.0", 10.5, 11.5), ("SEND_F0.0>0", 11.5, 11.6),
                 ("F0.1", 11.6, 12.5)]
"""Rank 1's receive for stage 3 ends at 9.0 s, 4.1 s before stage 2's send began: more than the longest span (rank
1's, 3.6 s). Paired by time order instead (the earliest send with the earliest-ending receive, per microbatch and
link), the sends at 11.0 and 13.1 s meet the receives ending at 9.0 and 10.5 s, 2.0 and 2.6 s apart: no step."""


@pytest.mark.parametrize("recorded", [True, False], ids=["placement recorded", "placement shown by the sends"])
def test_a_receive_before_its_send_is_found_by_its_stages(recorded):
    placement = Placement.interleaved(2, 2) if recorded else None
    with pytest.raises(TableFormatError) as caught:
        merge_rank_timelines([_part(0, RANK_0, placement), _part(1, CHUNK_1_EARLY, placement)], 0, "the step")
    message = str(caught.value)
    assert "rank 1's receive of the activation of mb 0, stage 2 -> 3 from rank 0 ended 4.1 s before" in message, message
    assert "clocks (t0_unix) disagree" in message and "\n" not in message, message


@pytest.mark.parametrize("skew", [-20.0, 0.0, 20.0])
def test_a_rank_off_by_more_than_a_step_is_refused_and_one_in_step_is_not(skew):
    """Rank 1's whole clock off by more than the longest span (rank 1's, 5 s): every pairing agrees on this one."""
    parts = [_part(0, RANK_0, Placement.interleaved(2, 2)), _part(1, IN_ORDER, Placement.interleaved(2, 2))]
    parts[1] = replace(parts[1], meta={**parts[1].meta, "t0_unix": 1000.0 + skew})
    if skew == 0.0:
        merged = merge_rank_timelines(parts, 0, "the step")
        assert merged.meta["placement"] == Placement.interleaved(2, 2).to_dict()
        return
    with pytest.raises(TableFormatError, match="rank 1") as caught:
        merge_rank_timelines(parts, 0, "the step")
    assert "clocks (t0_unix) disagree" in str(caught.value)


def test_rank_files_recording_different_placements_are_refused():
    parts = [_part(0, RANK_0, Placement.interleaved(2, 2)), _part(1, IN_ORDER, Placement.vshape(2))]
    with pytest.raises(TableFormatError, match="rank 0 and rank 1 record different placements"):
        merge_rank_timelines(parts, 0, "the step")


@pytest.mark.parametrize("algorithm, vpp", [("interleaved-1f1b", 2), ("zbv", 2), ("dualpipe-v", 2), ("1f1b", 1),
                                            ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("pp", [2, 4])
def test_the_layout_a_timeline_without_one_shows(algorithm, vpp, pp):
    """What the clock check pairs a dump by when it records no placement: the layout its sends show."""
    table = build_schedule(algorithm, pp=pp, microbatches=2 * pp, vpp=vpp)
    forwarded = (n.chunk for n in table.ranks[0] if n.kind.is_send and n.kind.carries is NodeKind.F)
    assert Placement.shown_by(pp, vpp, forwarded) == table.placement
