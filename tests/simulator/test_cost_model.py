"""The cost model: YAML form, 1F1B-stage values split over chunks, memory release rule."""

import dataclasses
import math

import pytest
from simulator_support import text_table

from primuspipe.errors import ConfigError
from primuspipe.ir.kinds import NodeKind
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, Link, MemoryCost, simulate, split_stages
from primuspipe.ir.cost_model import read_cost_file

YAML = """
time_unit: us
compute: {f: [2, 4], b: 2, w: 1, fb_overlap: 0.25}
p2p:
  message_bytes: 1000
  ranks_per_node: 1
  intra_node: {latency: 1}
  inter_node: {latency: 2, bandwidth: 500}
memory:
  activation_bytes: 100
  w_retained_fraction: 0.25
  parameter_bytes: [10, 20]
  gradient_bytes: 10
  optimizer_bytes: 40
"""


def test_yaml_form_resolves_per_shape(tmp_path):
    path = tmp_path / "cost.yaml"
    path.write_text(YAML)
    one = CostModel.load(path, pp=2, vpp=1)
    assert one.compute.forward == (2.0, 4.0) and one.duration(NodeKind.BW, 0) == 3.0 and one.time_unit == "us"
    assert one.p2p.transfer_time(0, 1) == 2 + 1000 / 500 and one.p2p.intra_node == Link(1, math.inf)
    assert one.memory.activation_bytes == (100.0, 100.0) and one.static_bytes(1) == 70.0
    two = CostModel.from_dict(read_cost_file(path), pp=2, vpp=2)
    assert two.compute.forward == (1.0, 1.0, 2.0, 2.0)  # each 1F1B stage cut into 2 chunks
    assert two.compute.backward_input == (1.0,) * 4
    assert two.memory.activation_bytes == (50.0,) * 4
    assert two.fb_overlap == 0.25
    assert CostModel.from_dict(one.to_dict(), pp=2, vpp=1) == one  # to_dict is the YAML form


def test_split_stages():
    assert split_stages("F", 3, pp=2, vpp=3) == (1.0,) * 6
    assert split_stages("F", [1, 2, 3, 4], pp=2, vpp=2) == (1.0, 2.0, 3.0, 4.0)  # one per model stage
    with pytest.raises(ConfigError, match=r"give one number, 2 \(one per 1F1B stage\) or 4"):
        split_stages("F", [1, 2, 3], pp=2, vpp=2)


@pytest.mark.parametrize("data,message", [
    ({"compute": {"f": 1, "b": 1}}, r"compute lacks \['w'\]"),
    ({"compute": {"f": 1, "b": 1, "w": 1, "fwd": 2}}, "unknown key"),
    ({"compute": {"f": 1, "b": 1, "w": -1}}, "must be >= 0"),
    ({"compute": {"f": "fast", "b": 1, "w": 1}}, "must be a number"),
    ({"compute": {"f": 1, "b": 1, "w": 1}, "p2p": {"intra_node": {"bandwidth": 0}}}, "bandwidth > 0"),
    ({"compute": {"f": 1, "b": 1, "w": 1}, "memory": {"activation_bytes": 1}}, "w_retained_fraction"),
    ({"compute": {"f": 1, "b": 1, "w": 1}, "time_unit": "hours"}, "time_unit"),
    ({"compute": {"f": 1, "b": 1, "w": 1, "fb_overlap": 2}}, "fb_overlap"),
    ([1, 2], "must be a mapping"),
])
def test_bad_cost_models_say_what_is_wrong(data, message):
    with pytest.raises(ConfigError, match=message):
        CostModel.from_dict(data, pp=2, vpp=1)


def test_unreadable_cost_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cost model"):
        read_cost_file(tmp_path / "missing.yaml")


@pytest.mark.parametrize("order,peak_bytes,peak_units", [
    ("F0.0 F1.0 B0.0 W0.0 B1.0 W1.0", 200, 2),  # both held at once
    ("F0.0 B0.0 F1.0 W0.0 B1.0 W1.0", 130, 1.3),  # B0 keeps 30 for W0 while F1 adds 100: units count it too
    ("F0.0 B0.0 W0.0 F1.0 B1.0 W1.0", 100, 1),
])
def test_activation_release_rule(order, peak_bytes, peak_units):
    memory = MemoryCost.per_stage(1, 1, activation_bytes=100, w_retained_fraction=0.3,
                                  parameter_bytes=1000, gradient_bytes=1000, optimizer_bytes=2000)
    rank = simulate(text_table(1, [order], m=2), CostModel.per_stage(1, 1, 1, 1, memory=memory)).ranks[0]
    assert rank.peak_activation_bytes == pytest.approx(peak_bytes)
    assert rank.peak_activations == peak_units
    assert rank.peak_memory_bytes == pytest.approx(4000 + peak_bytes)


@pytest.mark.parametrize("order,peak_bytes", [
    ("F0.0 B0.0 W0.0 F1.0 B1.0 W1.0", 125),  # B tops its 100 by a quarter while it runs
    ("F0.0 F1.0 B0.0 W0.0 B1.0 W1.0", 225),  # on top of the other microbatch
    ("F0.0 B0.0 F1.0 B1.0 W0.0 W1.0", 155),  # B1 rises over F1 and W0's kept 30
    ("F0.0 F1.0+B0.0 W0.0 B1.0 W1.0", 225),  # an overlapped F+B: B rises over the F it runs beside
    ("F0.0 BW0.0 F1.0 BW1.0", 100),  # a fused backward frees as it goes: no rise
])
def test_a_split_backward_peaks_above_its_start_by_the_rise(order, peak_bytes):
    """``b_rise_fraction``: what B keeps for W before it frees; the byte peaks count it, the microbatch units (the
    validator's count) do not, and a fused BW never rises."""
    memory = MemoryCost.per_stage(1, 1, activation_bytes=100, w_retained_fraction=0.3, b_rise_fraction=0.25)
    flat = dataclasses.replace(memory, b_rise_fraction=0.0)
    table = text_table(1, [order], m=2)
    rank = simulate(table, CostModel.per_stage(1, 1, 1, 1, memory=memory)).ranks[0]
    assert rank.peak_activation_bytes == pytest.approx(peak_bytes)
    units = simulate(table, CostModel.per_stage(1, 1, 1, 1, memory=flat)).ranks[0].peak_activations
    assert rank.peak_activations == units


@pytest.mark.parametrize("order,peak_bytes", [
    ("F0.0 B0.0 F1.0 W0.0 B1.0 W1.0", 240),  # W0 keeps 140 (all 100 and 40 more) while F1 adds 100
    ("F0.0 B0.0 W0.0 F1.0 B1.0 W1.0", 140),  # B ends above where it started
])
def test_what_w_keeps_beyond_the_microbatch_is_held_in_bytes_until_w(order, peak_bytes):
    """``w_excess_fraction``: W needs more than F left (sequence parallelism's all-gathered output gradients);
    the byte peaks hold it from B until W, the microbatch units stop at the whole microbatch."""
    memory = MemoryCost.per_stage(1, 1, activation_bytes=100, w_retained_fraction=1.0, w_excess_fraction=0.4)
    table = text_table(1, [order], m=2)
    rank = simulate(table, CostModel.per_stage(1, 1, 1, 1, memory=memory)).ranks[0]
    assert rank.peak_activation_bytes == pytest.approx(peak_bytes)
    assert rank.peak_activations == peak_bytes // 100


def test_the_rise_and_the_excess_are_cost_file_fields():
    model = CostModel.from_dict({"compute": {"f": 1, "b": 1, "w": 1},
                                 "memory": {"w_retained_fraction": 0.5, "b_rise_fraction": 0.4,
                                            "w_excess_fraction": 0.2}}, pp=2, vpp=1)
    assert (model.memory.b_rise_fraction, model.memory.w_excess_fraction) == (0.4, 0.2)
    assert CostModel.from_dict(model.to_dict(), pp=2, vpp=1) == model
    for name in ("b_rise_fraction", "w_excess_fraction"):
        for bad in (math.nan, -0.1, math.inf):
            with pytest.raises(ConfigError, match=name):
                MemoryCost(**{name: bad})


def test_fused_backward_releases_everything_and_bytes_follow_the_stage():
    table = build_schedule("1f1b", pp=2, microbatches=4)
    memory = MemoryCost.per_stage(2, 2, activation_bytes=[10, 30], w_retained_fraction=0.5, parameter_bytes=[1, 2])
    result = simulate(table, CostModel.per_stage(2, 1, 1, 1, memory=memory))
    assert [r.peak_activation_bytes for r in result.ranks] == [20, 30]  # rank 0 holds 2 mbs, rank 1 one
    assert result.peak_memory_bytes == [21, 32]


def test_memory_not_modelled_reports_zero_bytes():
    result = simulate(build_schedule("1f1b", pp=2, microbatches=2), CostModel.per_stage(2, 1, 1, 1))
    assert result.peak_memory_bytes == [0.0, 0.0]
    assert result.peak_activations == [2.0, 1.0]


def test_counting_bytes_without_activation_bytes_is_a_config_error():
    """A caller (a plug-in algorithm, say) that asks a model with no activation bytes for a byte peak is told
    so as the project's error, not by an assert that ``python -O`` would drop."""
    table = build_schedule("1f1b", pp=2, microbatches=4).compute_only()
    with pytest.raises(ConfigError, match="no activation bytes"):
        CostModel.per_stage(2, 1.0, 1.0, 1.0).memory.peak_bytes(table)
