"""Primus's pipeline keys in the Megatron config: each honoured with Primus's meaning, or refused with
the reason and what to use instead; costs and the memory limit reach the algorithms of a training run."""

import importlib.util
import json

import pytest
import yaml

from primuspipe.backends.megatron.config import PRIMUS_DEFAULT_COST, PrimusPipeConfig, load_config
from primuspipe.errors import ConfigError
from primuspipe.ir.activations import peak_in_flight

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


def test_costs_and_limit_become_the_cost_model_and_memory_limit(tmp_path):
    path = tmp_path / "primus_pipeline.yaml"
    path.write_text("pp_algorithm: zero-bubble-heuristic\npp_cost_f: 1000\npp_cost_b: [2000, 1500]\npp_max_mem: 3\n")
    options = load_config(path, env={}).schedule_options(pp=2, vpp=1)
    compute = options["cost"].compute
    assert (compute.forward, compute.backward_input, compute.backward_weight) == \
        ((1000.0, 1000.0), (2000.0, 1500.0), (PRIMUS_DEFAULT_COST,) * 2)
    assert options["memory_limit"] == 3.0
    assert options["cost"].memory.w_retained_fraction == 1.0, "Primus counts a microbatch whole until its W"
    assert PrimusPipeConfig().schedule_options(2, 1) == {}, "without Primus keys: no cost model, no limit"
    env = {"PRIMUSPIPE_PP_COST_W": "[500, 700]", "PRIMUSPIPE_PP_MAX_MEM": "2.5"}
    options = load_config(env=env).schedule_options(pp=2, vpp=2)
    assert options["cost"].compute.backward_weight == (500.0, 700.0) and options["memory_limit"] == 2.5


def test_cost_file_mapping_in_algorithm_options():
    config = PrimusPipeConfig(algorithm_options={"cost": {"compute": {"f": 1, "b": [2, 3], "w": 1}}})
    assert config.schedule_options(pp=2, vpp=1)["cost"].compute.backward_input == (2.0, 3.0)


def test_cost_file_path_in_algorithm_options(tmp_path):
    """algorithm_options.cost may name the file calibrate wrote: it is read once, when the config is built,
    and plans exactly as its mapping does; a missing file is refused then, naming it."""
    mapping = {"compute": {"f": 1, "b": [2, 3], "w": 1}, "host": {"cores": 1.5, "background": 0.05}}
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(mapping))
    by_path = PrimusPipeConfig(algorithm_options={"cost": str(path)}).schedule_options(pp=2, vpp=2)["cost"]
    assert by_path == PrimusPipeConfig(algorithm_options={"cost": mapping}).schedule_options(pp=2, vpp=2)["cost"]
    env = {"PRIMUSPIPE_ALGORITHM_OPTIONS": json.dumps({"cost": str(path)})}
    assert load_config(env=env).schedule_options(pp=2, vpp=2)["cost"] == by_path
    with pytest.raises(ConfigError, match="missing.yaml"):
        PrimusPipeConfig(algorithm_options={"cost": str(tmp_path / "missing.yaml")})


@pytest.mark.parametrize("values,match", [
    ({"communication_method": "batch_p2p"}, "batch_p2p is not supported.*use 'async_p2p'"),
    ({"communication_method": "nccl"}, "communication_method must be 'async_p2p'"),
    ({"offload": True}, "offload: true needs pp_max_mem.*set it, or offload: false"),
    ({"offload": True, "pp_max_mem": 2, "offload_ops": "attn"}, "offload_ops: attn moves only part.*set offload_fraction"),
    ({"offload_fraction": 1.5}, r"offload_fraction \(share of a chunk's activations, in \(0, 1\]\) must be <= 1"),
    ({"offload_fraction": 0}, "offload_fraction .* must be > 0"),
    ({"offload_ops": "attn,mlp"}, r"offload_ops: unknown op\(s\) \['mlp'\]"),
    ({"pp_max_mem": [4, 6]}, "one limit.*give one number"),
    ({"pp_max_mem": 0}, "pp_max_mem must be > 0"),
    ({"pp_max_mem": float("nan")}, "pp_max_mem must be >= 0 and finite"),
    ({"algorithm_options": {"costs": [1, 2, 1]}}, "costs is gone: give pp_cost_f"),
    ({"pp_cost_f": 1, "algorithm_options": {"cost": {"compute": {"f": 1, "b": 1, "w": 1}}}}, "give the costs once"),
    ({"pp_max_mem": 2, "algorithm_options": {"memory_limit": 3}}, "give the memory limit once"),
])
def test_keys_that_cannot_be_honoured_say_why_and_what_instead(values, match):
    with pytest.raises(ConfigError, match=match):
        PrimusPipeConfig(**values)


def test_per_stage_lists_must_match_the_pipeline():
    with pytest.raises(ConfigError, match="pp_cost_b has 3 values but there are 2 pipeline stages"):
        PrimusPipeConfig(pp_cost_b=[1, 2, 3]).schedule_options(pp=2, vpp=1)
    with pytest.raises(ConfigError, match="PRIMUSPIPE_PP_COST_F: bad value"):
        load_config(env={"PRIMUSPIPE_PP_COST_F": "fast"})


def test_offload_ops_name_megatron_submodules_and_the_plan_uses_their_share():
    config = PrimusPipeConfig(offload=True, pp_max_mem=2, offload_ops="attn, row_parallel_gemm", offload_fraction=0.4)
    assert config.offload_op_list == ("attn", "row_parallel_gemm")
    assert config.offload_modules == ("core_attention", "linear_proj", "linear_fc2")
    cost, limit = config.offload_plan(pp=2, vpp=2)
    assert (limit, cost.memory.offload_fraction, cost.memory.w_retained_fraction) == (2.0, 0.4, 1.0)
    assert "memory_limit" not in config.schedule_options(pp=2, vpp=2), "the pass meets pp_max_mem, not the algorithm"
    assert PrimusPipeConfig(pp_max_mem=2).offload_plan(pp=2, vpp=2) is None


@needs_megatron
def test_training_run_builds_with_the_costs_and_the_limit():
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward

    limited = PrimusForwardBackward(PrimusPipeConfig(True, "zero-bubble-heuristic", pp_max_mem=3)).table_for(4, 1, 8)
    assert limited.algorithm == "zb-auto" and max(peak_in_flight(limited, retained=1.0)) <= 3
    unlimited = PrimusForwardBackward(PrimusPipeConfig(True, "zero-bubble-heuristic")).table_for(4, 1, 8)
    assert max(peak_in_flight(unlimited, retained=1.0)) > 3, "the limit is what kept it at 3"
    slow_w = PrimusForwardBackward(PrimusPipeConfig(True, "zb-h1", pp_cost_w=[1000, 1000, 1000, 8000]))
    assert slow_w.table_for(4, 1, 8) != PrimusForwardBackward(PrimusPipeConfig(True, "zb-h1")).table_for(4, 1, 8), \
        "the costs reached the cost-aware algorithm"
    options = PrimusForwardBackward(PrimusPipeConfig(True, "zb-h1", algorithm_options={
        "cost": {"compute": {"f": 1, "b": 1, "w": [1, 1, 1, 8]}}})).table_for(4, 1, 8)
    assert options == slow_w.table_for(4, 1, 8)


@needs_megatron
def test_primus_interleaved_name_follows_megatrons_group_size_too():
    from types import SimpleNamespace

    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward

    megatron = SimpleNamespace(microbatch_group_size_per_vp_stage=3)
    ours, primus = (PrimusForwardBackward(PrimusPipeConfig(True, name)).table_for(2, 2, 6, megatron)
                    for name in ("interleaved-1f1b", "1f1b-interleaved"))
    assert primus == ours != PrimusForwardBackward(PrimusPipeConfig(True, "1f1b-interleaved")).table_for(2, 2, 6)


@needs_megatron
def test_a_group_size_megatron_refuses_is_named_as_megatrons_field():
    """Megatron's interleaved schedule raises on a microbatch_group_size_per_vp_stage outside [pp, m] or leaving
    a last group under pp (schedules.py); the table refuses the same values, naming Megatron's field (which the
    user set), not only the option it became. Megatron's default (pp) is ours, so it is never refused."""
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.errors import ScheduleShapeError
    from primuspipe.testing.megatron.tiny_models import TINY_MODELS, transformer_config

    enable_cpu_mode()

    def megatron(group):  # Megatron's TransformerConfig, its __post_init__ setting the default group (pp)
        return transformer_config(TINY_MODELS["tiny-gpt"], 4, 2, microbatch_group_size_per_vp_stage=group)

    ours = PrimusForwardBackward(PrimusPipeConfig(True, "interleaved-1f1b"))
    for group, m in ((3, 8), (9, 8), (5, 7)):
        with pytest.raises(ScheduleShapeError, match=f"^Megatron's microbatch_group_size_per_vp_stage={group}, which "
                                                     "interleaved-1f1b follows unless algorithm_options"):
            ours.table_for(4, 2, m, megatron(group))
    assert ours.table_for(4, 2, 6, megatron(None)).microbatches == 6, \
        "Megatron's own schedule raises at m=6 with its default group (4); ours runs it"
    chosen = PrimusForwardBackward(PrimusPipeConfig(True, "interleaved-1f1b",
                                                    algorithm_options={"microbatch_group_size": 8}))
    assert chosen.table_for(4, 2, 8, megatron(3)).microbatches == 8, "algorithm_options' group takes precedence"


@needs_megatron
def test_zb_auto_under_offload_weighs_the_offload_pass_as_simulate_does():
    """``offload: true`` with zb-auto: the search gets pp_max_mem and weighs the fixed tables the offload pass
    brings under it against its own constructions (``offload_options``, what ``simulate --offload`` uses).
    Before, zb-auto planned without the limit and the pass could not bring that table under it (OffloadError
    at pp 4, m 8, limit 2); now it fits and is never behind the best fixed table with the pass's copies."""
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.passes.offload import OffloadError, offload_activations
    from primuspipe.simulator import simulate

    config = PrimusPipeConfig(True, "zb-auto", offload=True, pp_max_mem=2)
    cost, limit = config.offload_plan(4, 2)
    cost = cost.for_shape(4, 2)
    table = PrimusForwardBackward(config).table_for(4, 2, 8)
    assert max(simulate(table, cost).peak_activations) <= limit
    fixed = []
    for name in ("v-half", "zbv", "v-min", "interleaved-1f1b"):
        try:
            offloaded = offload_activations(build_schedule(name, 4, 8, 2, cost=cost), cost, memory_limit=limit)
            fixed.append(simulate(offloaded, cost).step_time)
        except OffloadError:
            continue
    assert fixed and simulate(table, cost).step_time <= min(fixed)
    with pytest.raises(OffloadError):  # what the backend did before: plan without the limit, then the pass
        offload_activations(build_schedule("zb-auto", 4, 8, 2, cost=cost), cost, memory_limit=limit)
