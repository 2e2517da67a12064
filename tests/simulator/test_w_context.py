"""What a W costs by where it runs (``compute.w_warm``): warm (right after its own B or another W of its
chunk on its rank) or cold (anywhere else). One rule (``warm_weight_grad``) for the simulator, calibration and
the cost file."""

import pytest
import yaml

from primuspipe.algorithms.build import build_schedule
from primuspipe.calibration.measure import measure_costs
from primuspipe.errors import ConfigError
from primuspipe.ir.row_context import warm_weight_grad
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import B, BW, F, W
from primuspipe.passes.communication import add_communication
from primuspipe.passes.split_probe import split_backward_probe
from primuspipe.simulator import CostModel, simulate

SHAPES = [("zb-h1", 2, 1), ("zb-h1", 4, 1), ("zb-h2", 4, 1), ("zbv", 2, 2), ("v-half", 3, 2), ("zb-auto", 3, 1)]


def test_the_context_rule():
    assert warm_weight_grad(B(3), W(3)) and warm_weight_grad(W(2), W(3)) and warm_weight_grad(W(7, 1), W(3, 1))
    assert not warm_weight_grad(B(3, 1), W(3, 0)) and not warm_weight_grad(W(2, 1), W(3, 0))  # another chunk's
    assert not warm_weight_grad(B(4), W(3)) and not warm_weight_grad(F(4), W(3)) and not warm_weight_grad(BW(2), W(3))
    assert not warm_weight_grad(None, W(0)) and not warm_weight_grad(B(2), BW(2)) and not warm_weight_grad(B(2), B(2))


def _contexts(table):
    """Per rank, per W node: whether it is warm, read off the compute row directly (the node before it is
    its own B, or a W of its chunk)."""
    out = []
    for row in table.compute_only().ranks:
        out.append({n: i > 0 and row[i - 1].chunk == n.chunk and (
            row[i - 1].kind is NodeKind.W or row[i - 1].kind is NodeKind.B and row[i - 1].microbatch == n.microbatch)
            for i, n in enumerate(row) if n.kind is NodeKind.W})
    return out


@pytest.mark.parametrize("algorithm,pp,vpp", SHAPES)
def test_the_simulator_charges_a_w_after_its_own_b_the_hot_cost_and_any_other_the_cold_one(algorithm, pp, vpp):
    n = pp * vpp
    hot, cold = [0.25 + 0.05 * s for s in range(n)], [1.0 + 0.1 * s for s in range(n)]
    cost = CostModel.per_stage(n, 1.0, 1.5, cold, w_warm=hot)
    table = build_schedule(algorithm, pp, 4 * pp, vpp)
    timeline = simulate(table, cost).timeline()
    placement = table.placement
    seen = set()
    for rank, (events, contexts) in enumerate(zip(sorted(timeline.ranks, key=lambda r: r.rank), _contexts(table))):
        for e in events.events:
            if e.node.kind is NodeKind.W:
                stage = placement.stage(rank, e.node.chunk)
                expected = hot[stage] if contexts[e.node] else cold[stage]
                assert e.end - e.start == pytest.approx(expected), f"rank {rank} {e.node}"
                seen.add(contexts[e.node])
    assert seen == {True, False}, "the shape should run W in both contexts"
    # without the field, every W takes the one W time (old behaviour)
    plain = simulate(table, CostModel.per_stage(n, 1.0, 1.5, cold)).timeline()
    assert all(e.end - e.start == pytest.approx(cold[table.placement.stage(rt.rank, e.node.chunk)])
               for rt in plain.ranks for e in rt.events if e.node.kind is NodeKind.W)


def test_an_old_cost_file_without_the_field_loads_with_w_context_free():
    old = {"time_unit": "s", "compute": {"f": [1.0, 1.2], "b": [1.0, 1.1], "w": [0.8, 0.9], "bw": [1.7, 1.9]}}
    model = CostModel.from_dict(old, pp=2, vpp=2)
    assert model.w_warm is None and "w_warm" not in model.to_dict()["compute"]
    zbh1 = build_schedule("zb-h1", 2, 8)
    flat = CostModel.from_dict(old, pp=2, vpp=1)
    assert simulate(zbh1, flat).step_time == simulate(zbh1, CostModel.from_dict(
        {**old, "compute": {**old["compute"], "w_warm": [0.8, 0.9]}}, pp=2, vpp=1)).step_time


def test_the_file_field_is_cut_for_vpp_like_the_layers_and_round_trips():
    data = {"compute": {"f": 2.0, "b": 2.0, "w": [2.0, 3.0], "w_warm": [1.0, 2.5]}}
    model = CostModel.from_dict(data, pp=2, vpp=2)
    assert model.compute.backward_weight == (1.0, 1.0, 1.5, 1.5)
    assert model.w_warm == (0.5, 0.5, 1.25, 1.25)  # each chunk saves its share of its stage's saving
    assert model.for_shape(2, 1).w_warm == pytest.approx((1.0, 2.5))
    assert CostModel.from_dict(yaml.safe_load(yaml.safe_dump(model.to_dict())), pp=2, vpp=2) == model
    with_fixed = CostModel.from_dict({"compute": {**data["compute"], "fixed": {"w": [0.4, 0.4]}}}, pp=2, vpp=2)
    saving = [w - h for w, h in zip(with_fixed.compute.backward_weight, with_fixed.w_warm)]
    assert saving == pytest.approx([0.5, 0.5, 0.25, 0.25])  # the fixed part is not what the cache saves


@pytest.mark.parametrize("value,message", [(-1.0, "compute.w_warm"), ([1.0, 2.0, 3.0], "compute.w_warm has 3"),
                                          ("fast", "compute.w_warm")])
def test_bad_values_name_the_field(value, message):
    with pytest.raises(ConfigError, match=message):
        CostModel.from_dict({"compute": {"f": 1, "b": 1, "w": 1, "w_warm": value}}, pp=2, vpp=1)


@pytest.mark.parametrize("pp", [2, 4])
def test_calibration_of_a_probed_1f1b_run_recovers_both_w_costs_and_predicts_zb_h1(pp):
    """The probe runs W in both contexts on every rank; calibrated from its timeline, the file predicts a
    split-backward schedule's step exactly as the true costs do."""
    f, b = [1.0 + 0.1 * s for s in range(pp)], [1.5] * pp
    cold, hot = [2.0 - 0.2 * s for s in range(pp)], [0.6 + 0.1 * s for s in range(pp)]  # rank 0 bounds the step
    truth = CostModel.per_stage(pp, f, b, cold, bw=[x + y for x, y in zip(b, cold)], w_warm=hot, time_unit="s")
    probed = add_communication(split_backward_probe(build_schedule("1f1b", pp, 8).compute_only()))
    timeline = simulate(probed, truth).timeline()
    measured = measure_costs([timeline, timeline])
    assert measured.backward_weight == pytest.approx(cold) and measured.w_warm == pytest.approx(hot)
    calibrated = CostModel.from_dict(measured.cost_dict(), pp=pp, vpp=1)
    for algorithm in ("zb-h1", "zb-h2"):
        table = build_schedule(algorithm, pp, 8)
        assert simulate(table, calibrated).step_time == pytest.approx(simulate(table, truth).step_time)
    # calibrated as one W time (the file written before the field existed), zb-h1 is mispredicted
    data = measured.cost_dict()
    context_free = CostModel.from_dict(data | {"compute": {k: v for k, v in data["compute"].items() if k != "w_warm"}},
                                       pp=pp, vpp=1)
    table = build_schedule("zb-h1", pp, 8)
    assert simulate(table, context_free).step_time > simulate(table, truth).step_time * 1.01
