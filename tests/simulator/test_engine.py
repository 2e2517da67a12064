"""The event loop: exact event logs, determinism, communication costs, FB nodes and failures."""

import pytest
from simulator_support import text_table

from primuspipe.passes.communication import add_communication
from primuspipe.errors import SimulationError, ValidationError
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, Link, P2PCost, simulate


def test_exact_event_log_with_p2p_latency():
    """1F1B pp=2, m=2, F=B=W=1 (BW=2), every transfer 0.5.

    A transfer starts once both its send and its receive are posted: RECV_F1.0 on rank 1 is posted only
    at 2.5 (after F0.0), so F1.0's activation, sent at 2.0, arrives at 3.0.
    """
    table = build_schedule("1f1b", pp=2, microbatches=2)
    result = simulate(table, CostModel.per_stage(2, 1, 1, 1, p2p=P2PCost(intra_node=Link(latency=0.5))))
    assert result.event_log() == [
        (0.0, 1.0, 0, "F0.0"),
        (0.0, 1.5, 1, "RECV_F0.0<0"),
        (1.0, 1.5, 0, "SEND_F0.0>1"),
        (1.0, 5.0, 0, "RECV_B0.0<1"),
        (1.0, 2.0, 0, "F1.0"),
        (1.5, 2.5, 1, "F0.0"),
        (2.0, 3.0, 0, "SEND_F1.0>1"),
        (2.0, 8.0, 0, "RECV_B1.0<1"),
        (2.5, 3.0, 1, "RECV_F1.0<0"),
        (2.5, 4.5, 1, "BW0.0"),
        (4.5, 5.0, 1, "SEND_B0.0>0"),
        (4.5, 5.5, 1, "F1.0"),
        (5.0, 7.0, 0, "BW0.0"),
        (5.5, 7.5, 1, "BW1.0"),
        (7.5, 8.0, 1, "SEND_B1.0>0"),
        (8.0, 10.0, 0, "BW1.0"),
    ]
    assert result.step_time == 10.0
    assert [r.busy_time for r in result.ranks] == [6.0, 6.0]
    assert [r.bubble_rate for r in result.ranks] == [0.4, 0.4]


def test_deterministic():
    table = build_schedule("interleaved-1f1b", pp=4, microbatches=8, vpp=2)
    cost = CostModel.per_stage(8, [1, 2, 1, 1, 3, 1, 1, 1], 1.5, 0.5,
                               p2p=P2PCost(1e6, Link(0.1, 1e7), Link(0.3, 1e6), ranks_per_node=2))
    first, second = simulate(table, cost), simulate(table, cost)
    assert first == second
    assert first.event_log() == second.event_log()
    assert first.timeline().to_dict() == second.timeline().to_dict()


def test_compute_only_table_gets_its_communication_added():
    full = build_schedule("1f1b", pp=3, microbatches=4)
    cost = CostModel.per_stage(3, 1, 1, 1, p2p=P2PCost(intra_node=Link(latency=0.25)))
    from_compute_only = simulate(full.compute_only(), cost)
    assert from_compute_only.table == add_communication(full.compute_only())
    assert from_compute_only.step_time == simulate(full, cost).step_time


def test_intra_and_inter_node_links():
    p2p = P2PCost(message_bytes=100, intra_node=Link(1, 100), inter_node=Link(5, 10), ranks_per_node=2)
    assert p2p.transfer_time(0, 1) == 2.0
    assert p2p.transfer_time(1, 2) == 15.0
    table = build_schedule("1f1b", pp=4, microbatches=1)
    # one microbatch walks 0 -> 1 -> 2 -> 3 and back: 4 F, 4 BW, and each hop's link twice
    result = simulate(table, CostModel.per_stage(4, 1, 1, 0, p2p=p2p))
    assert result.step_time == 4 * 1 + 4 * 1 + 2 * (2 + 15 + 2)


def test_fb_node_costs_through_the_overlap_factor():
    table = text_table(1, ["F0.0 F1.0+B0.0 W0.0 B1.0 W1.0"], m=2)
    base = dict(f=1, b=2, w=1)
    assert simulate(table, CostModel.per_stage(1, **base)).step_time == 1 + 3 + 1 + 2 + 1
    assert simulate(table, CostModel.per_stage(1, **base, fb_overlap=0.5)).step_time == 1 + 2.5 + 1 + 2 + 1
    assert simulate(table, CostModel.per_stage(1, **base, fb_overlap=1.0)).step_time == 1 + 2 + 1 + 2 + 1
    assert simulate(table, CostModel.per_stage(1, **base)).peak_activations == [2.0]  # FB holds both F's


def test_fused_backward_time_defaults_to_b_plus_w_and_can_be_given():
    table = build_schedule("1f1b", pp=1, microbatches=3)
    assert simulate(table, CostModel.per_stage(1, 1, 2, 3)).step_time == 3 * (1 + 5)
    assert simulate(table, CostModel.per_stage(1, 1, 2, 3, bw=4)).step_time == 3 * (1 + 4)


def test_wrong_number_of_stages_is_refused():
    with pytest.raises(SimulationError, match="describes 4 stages but the table has 8"):
        simulate(build_schedule("interleaved-1f1b", pp=4, microbatches=4, vpp=2), CostModel.per_stage(4, 1, 1, 1))


def test_deadlocked_table_raises_instead_of_hanging():
    # rank 0 waits for the gradient of mb 0 before sending F1; rank 1 wants F1 before it runs BW0
    table = add_communication(text_table(2, ["F0.0 BW0.0 F1.0 BW1.0", "F0.0 F1.0 BW0.0 BW1.0"], m=2))
    with pytest.raises(SimulationError, match=r"cannot complete.*rank 0 .*BW0\.0.*validate"):
        simulate(table, CostModel.per_stage(2, 1, 1, 1))


def test_receive_posted_after_its_consumer_is_refused_by_the_order_rule():
    """An unproven table is held to the validator's rules on each rank's steps before it is timed."""
    table = text_table(2, ["F0.0 SEND_F0.0>1 RECV_B0.0<1 BW0.0", "F0.0 RECV_F0.0<0 BW0.0 SEND_B0.0>0"], m=1)
    with pytest.raises(ValidationError, match=r"\[order\] rank 1 node 0 \(F0.0\) needs the activation of mb 0"):
        simulate(table, CostModel.per_stage(2, 1, 1, 1))


def test_sends_after_the_peers_wait_raise():
    """Each rank sends only after a backward that waits for the other's send: the replay names both waits."""
    table = text_table(2, ["F0.0 RECV_B0.0<1 BW0.0 SEND_F0.0>1", "RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0"], m=1)
    with pytest.raises(SimulationError, match="rank 0 at node 2 .*waits for the gradient of mb 0.*rank 1 at node 1 "
                                              ".*waits for the activation of mb 0"):
        simulate(table, CostModel.per_stage(2, 1, 1, 1))


def test_swapped_receives_are_reported_not_silently_matched():
    rows = ["F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 BW0.0 RECV_B1.0<1 BW1.0",
            "RECV_F1.0<0 RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0 F1.0 BW1.0 SEND_B1.0>0"]
    with pytest.raises(SimulationError, match="expects another tensor"):
        simulate(text_table(2, rows, m=2), CostModel.per_stage(2, 1, 1, 1))


def test_unmatched_send_raises():
    rows = ["F0.0 SEND_F0.0>1 SEND_F0.0>1 RECV_B0.0<1 BW0.0", "RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0"]
    with pytest.raises(ValidationError, match=r"\[completeness\].* has 2 send nodes"):
        simulate(text_table(2, rows, m=1), CostModel.per_stage(2, 1, 1, 1))
