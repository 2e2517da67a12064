from collections import defaultdict

import pytest
from hypothesis import given
from schedule_strategies import tables

from primuspipe.passes.communication import add_communication
from primuspipe.ir.dataflow import transfer_of
from primuspipe.errors import TableFormatError
from primuspipe.ir.node import BW, F, NodeKind
from primuspipe.ir.placement import Placement
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.table import ScheduleTable


def test_sends_follow_their_producer_and_receives_precede_consumer_by_one_step():
    table = build_schedule("1f1b", pp=2, microbatches=2)
    assert [str(n) for n in table.ranks[0]] == [
        "F0.0", "SEND_F0.0>1", "RECV_B0.0<1", "F1.0", "SEND_F1.0>1", "RECV_B1.0<1", "BW0.0", "BW1.0"]
    assert [str(n) for n in table.ranks[1]] == [
        "RECV_F0.0<0", "F0.0", "RECV_F1.0<0", "BW0.0", "SEND_B0.0>0", "F1.0", "BW1.0", "SEND_B1.0>0"]


def test_local_hand_offs_get_no_communication():
    # V-shape: stages pp-1 and pp are both on the last rank, the first and last stage on rank 0.
    p = 2
    rows = [[F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)], [F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)]]
    table = add_communication(ScheduleTable.build(Placement.vshape(p), 1, rows))
    last = [str(n) for n in table.ranks[1]]
    assert last == ["RECV_F0.0<0", "F0.0", "RECV_B0.1<0", "F0.1", "SEND_F0.1>0", "BW0.1", "BW0.0", "SEND_B0.0>0"]


@given(tables())
def test_receives_follow_the_senders_order_per_direction(table):
    lanes = defaultdict(list)
    for rank, _, node in table.positions():
        if not node.kind.is_compute:
            key = (rank, node.peer, "send") if node.kind.is_send else (node.peer, rank, "recv")
            lanes[key].append(transfer_of(table.placement, rank, node))
    for (src, dst, what), seq in lanes.items():
        if what == "send":
            assert lanes[(src, dst, "recv")] == seq


def test_receive_is_pulled_earlier_when_consumption_order_differs_from_send_order():
    # rank 1 consumes mb 1 before mb 0, while rank 0 sends mb 0 first: both receives are posted
    # before the first consumer, in rank 0's send order.
    rows = [[F(0), F(1), BW(0), BW(1)], [F(1), F(0), BW(0), BW(1)]]
    table = add_communication(ScheduleTable.build(Placement.interleaved(2), 2, rows))
    recvs = [str(n) for n in table.ranks[1] if n.kind is NodeKind.RECV_F]
    assert recvs == ["RECV_F0.0<0", "RECV_F1.0<0"]
    assert [str(n) for n in table.ranks[1][:3]] == ["RECV_F0.0<0", "RECV_F1.0<0", "F1.0"]


def test_pass_refuses_a_table_that_already_communicates():
    with pytest.raises(TableFormatError, match="compute-only"):
        add_communication(build_schedule("1f1b", 2, 2))
