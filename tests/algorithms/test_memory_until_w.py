"""Memory counted as the device holds it: each microbatch from its F until its W, at the cost model's
retained share between B and W, one count everywhere (simulator, validator, CLI, algorithms)."""

import math

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.cli import main
from primuspipe.errors import ConfigError, ValidationError
from primuspipe.ir.activations import W_RETAINED_FRACTION, peak_in_flight
from primuspipe.ir.cost_model import CostModel, MemoryCost
from primuspipe.ir.node import B, F, W
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import validate
from primuspipe.simulator import simulate


def test_the_default_share_is_the_zero_bubble_papers_m_w_over_m_b_with_flash_attention():
    assert W_RETAINED_FRACTION == pytest.approx(32 / 34)
    assert CostModel.per_stage(2, 1, 1, 1).memory.w_retained_fraction == W_RETAINED_FRACTION


def test_peaks_count_a_deferred_w():
    """ZB-H1 at pp = 2: rank 1 defers W's, so counted until W it holds more than its one forward in flight."""
    table = build_schedule("zb-h1", 2, 4)
    assert peak_in_flight(table, retained=0.0) == [2, 1]  # the papers' count, F until B
    whole = peak_in_flight(table, retained=1.0)
    assert max(whole) <= 2 and whole[1] > 1  # rank 1 keeps a W's inputs while its next F runs
    result = simulate(table, CostModel.per_stage(2, 1, 1, 1, memory=MemoryCost(0.5)))
    assert result.peak_activations == peak_in_flight(table, retained=0.5)


def test_the_memory_section_may_give_the_share_alone_bytes_need_it():
    model = CostModel.from_dict({"compute": {"f": 1, "b": 1, "w": 1}, "memory": {"w_retained_fraction": 0.25}}, pp=2, vpp=1)
    assert model.memory.w_retained_fraction == 0.25 and not model.memory.models_bytes
    assert CostModel.from_dict(model.to_dict(), pp=2, vpp=1) == model
    with pytest.raises(ConfigError, match="w_retained_fraction"):
        CostModel.from_dict({"compute": {"f": 1, "b": 1, "w": 1}, "memory": {"activation_bytes": 1}}, pp=2, vpp=1)
    for bad in (math.nan, 1.5, -0.1):
        with pytest.raises(ConfigError, match="w_retained_fraction must be in"):
            MemoryCost(bad)


def test_a_model_recut_for_another_vpp_keeps_each_1f1b_stage_s_totals():
    model = CostModel.per_stage(2, [1, 3], 2, 1, memory=MemoryCost.per_stage(2, 2, activation_bytes=[4, 8]))
    two = model.for_shape(2, 2)
    assert two.compute.forward == (0.5, 0.5, 1.5, 1.5) and two.memory.activation_bytes == (2, 2, 4, 4)
    assert two.for_shape(2, 1) == model
    with pytest.raises(ConfigError, match="cannot be cut"):
        model.for_shape(3, 1)


def test_the_validator_and_the_cli_count_until_w(tmp_path, capsys):
    """One rank that runs F1 before W0: counted until W it holds two microbatches at F1, one F until B."""
    table = ScheduleTable.build(Placement.interleaved(1, 1), 2, [[F(0), B(0), F(1), W(0), B(1), W(1)]], "deferred-w")
    with pytest.raises(ValidationError, match="W.*earlier"):
        validate(table, max_in_flight=1.5, retained=1.0)
    validate(table, max_in_flight=1.5, retained=0.0)  # the papers' count misses what the device holds
    path = tmp_path / "zb.json"
    path.write_text(table.to_json())
    assert main(["validate", str(path), "--max-in-flight", "1.5", "--w-retained", "1"]) == 1
    assert main(["validate", str(path), "--max-in-flight", "1.5", "--w-retained", "0"]) == 0
    capsys.readouterr()


def test_simulate_passes_the_model_it_times_with(capsys):
    """--p2p reaches the algorithms: planned with P2P time, zbv is not slower than planned without it."""
    import json

    assert main(["simulate", "-a", "zbv", "--pp", "4", "-m", "8", "--p2p", "0.2", "--w-retained", "1", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["results"]
    cost = CostModel.per_stage(4, 1, 1, 1, memory=MemoryCost(1.0)).for_shape(4, 2)
    from primuspipe.ir.cost_model import Link, P2PCost
    slow = CostModel.per_stage(4, 1, 1, 1, memory=MemoryCost(1.0),
                               p2p=P2PCost(intra_node=Link(0.2), inter_node=Link(0.2))).for_shape(4, 2)
    blind = simulate(build_schedule("zbv", 4, 8, cost=cost), slow).step_time
    assert row["w_retained_fraction"] == 1.0 and row["step_time"] <= blind
