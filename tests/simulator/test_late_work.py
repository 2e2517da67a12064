"""Work one stage's W (or BW) runs only from some microbatch on (``compute.late_w``, :class:`LateWork`): the one
cost that depends on a node's microbatch, megatron-core's partial deferral of the output layer's weight
gradients (``wgrad_deferral_limit``)."""

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError
from primuspipe.ir.cost_parts import LateWork
from primuspipe.ir.node import B, BW, F, W
from primuspipe.ir.placement import Placement
from primuspipe.simulator import CostModel, simulate


def test_only_the_stages_weight_gradients_from_the_first_microbatch_on_take_it():
    cost = CostModel.per_stage(2, f=1, b=1, w=1, late_w=LateWork(stage=1, first=2, time=0.5))
    placement = Placement.interleaved(2, 1)
    assert [cost.node_time(placement, 1, node) for node in (BW(1), BW(2), W(3), B(3), F(3))] == [2, 2.5, 1.5, 1, 1]
    assert [cost.node_time(placement, 0, node) for node in (BW(2), W(3))] == [2, 1]  # another stage's


def test_a_small_1f1b_step_against_its_timeline_by_hand():
    """pp 2, four microbatches, F 1 and BW 2 everywhere, free transfers; the last stage's BW of microbatches 2
    and 3 takes 1 more. By hand: rank 1 runs F0 1-2, BW0 2-4, F1 4-5, BW1 5-7, F2 7-8 (rank 0's F2 ends at 7),
    BW2 8-11, F3 11-12, BW3 12-15; rank 0's BW2 waits for it until 11 (11-13), its BW3 until 15 (15-17)."""
    cost = CostModel.per_stage(2, f=1, b=1, w=1, late_w=LateWork(stage=1, first=2, time=1.0))
    result = simulate(build_schedule("1f1b", 2, 4, 1, cost=cost), cost)
    last = result.ranks[1]
    assert [(str(n), s, e) for n, s, e in zip(last.nodes, last.starts, last.ends) if n.kind.is_compute] == [
        ("F0.0", 1, 2), ("BW0.0", 2, 4), ("F1.0", 4, 5), ("BW1.0", 5, 7), ("F2.0", 7, 8), ("BW2.0", 8, 11),
        ("F3.0", 11, 12), ("BW3.0", 12, 15)]
    assert result.step_time == 17.0
    plain = CostModel.per_stage(2, f=1, b=1, w=1)
    assert simulate(build_schedule("1f1b", 2, 4, 1, cost=plain), plain).step_time == 15.0


def test_the_file_form_round_trips_and_a_recut_keeps_it_on_the_stage_that_ends_the_old_one():
    cost = CostModel.per_stage(4, f=1, b=1, w=1, late_w=LateWork(stage=3, first=5, time=0.25))
    assert CostModel.from_dict(cost.to_dict(), pp=4, vpp=1).late_w == cost.late_w
    assert cost.for_shape(4, 2).late_w == LateWork(stage=7, first=5, time=0.25)
    assert cost.for_shape(2, 1).late_w == LateWork(stage=1, first=5, time=0.25)
    with pytest.raises(ConfigError, match="late_w.stage 4 is not one of the 4 stages"):
        CostModel.per_stage(4, f=1, b=1, w=1, late_w=LateWork(stage=4, first=0, time=1.0))
