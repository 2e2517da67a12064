"""Reading the projection's inputs: shipped examples, the built-in training default, Megatron argument
lists and Primus-style YAML, and one clear error for every kind of bad or inconsistent input."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from primuspipe.projection.framework import ConfigError
from primuspipe.projection.gemm_fit import load_measurements
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import from_arguments, load_megatron_config
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.spec_fields import InputError, spec_from_mapping
from primuspipe.projection.training_spec import TrainingSpec, check_compatible, load_training

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
MODELS = sorted((EXAMPLES / "models").glob("*.yaml"))
HARDWARE = sorted((EXAMPLES / "hardware").glob("*.yaml"))
TRAININGS = sorted((EXAMPLES / "training").glob("*.yaml"))
SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100)


def test_every_shipped_example_loads():
    assert {p.stem for p in MODELS} == {"llama2-7b", "llama3-70b", "mixtral-8x7b", "mixtral-8x22b", "qwen3-235b-a22b",
                                        "deepseek-v2-lite", "deepseek-v2", "llama3-8b", "llama3.1-405b", "llama2-70b",
                                        "gpt3-175b", "gpt-oss-120b", "gpt-oss-20b", "kimi-k2",
                                        "qwen3-30b-a3b", "qwen3-32b", "deepseek-v3", "gpt3-5b", "gpt3-20b", "llama2-13b",
                                        "nemotron3-8b", "nemotron3-22b", "nemotron4-340b", "nemotron4-15b", "mistral-7b-w1024",
                                        *(f"mcore08-gpt-{size}" for size in
                                          ("1.7b", "7.1b", "16b", "32b", "70b", "119b", "177b", "314b", "462b"))}
    assert {p.stem for p in HARDWARE} == {"mi300x", "mi325x", "mi355x", "h100", "h200", "b200", "gb200",
                                          "gb300", "h100-hbm2e"}
    for path in MODELS:
        assert load_model(path).source == str(path)
    for path in HARDWARE:
        assert load_hardware(path).hbm_bytes > 0
    for path in TRAININGS:
        load_training(path)


def test_the_hbm2e_h100_is_the_h100_but_for_its_memory():
    """h100-hbm2e.yaml publishes only its memory size and bandwidth; every other figure is h100.yaml's, and must
    follow it when h100.yaml changes (its FlashAttention-2 entry included)."""
    sxm = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    hbm2e = load_hardware(EXAMPLES / "hardware" / "h100-hbm2e.yaml")
    assert (hbm2e.hbm_bytes, hbm2e.hbm_bandwidth_bytes_per_s) == (96 * 2**30, 2.4e12)
    assert hbm2e.attention_kernels == {"flash2": sxm.attention_kernels["flash2"]}
    own = dict(name=hbm2e.name, hbm_bytes=hbm2e.hbm_bytes, hbm_bandwidth_bytes_per_s=hbm2e.hbm_bandwidth_bytes_per_s,
               attention_kernels=hbm2e.attention_kernels, source=hbm2e.source)
    assert dataclasses.replace(sxm, **own) == hbm2e
    assert load_hardware(EXAMPLES / "hardware" / "h200.yaml").attention_kernels["flash2"] == sxm.attention_kernels["flash2"]


def test_the_gb200_takes_the_b200s_unmeasured_figures():
    """gb200.yaml takes from b200.yaml each figure no GB200 source gives (the GPUs share a die): they must follow
    b200.yaml when it changes (a refit of its sustained fractions or kernel costs). The GB200's own figures -- peaks,
    memory, fabric, MAMF, attention, HybridEP and DeepEP rates -- are its sources'; its narrow-head attention rates,
    measured on a GB200, are the ones b200.yaml takes."""
    b200 = load_hardware(EXAMPLES / "hardware" / "b200.yaml")
    gb200 = load_hardware(EXAMPLES / "hardware" / "gb200.yaml")
    taken = ("sustained_fraction", "fp8_sustained_fraction", "mxfp8_cast_bandwidth_fraction", "compute_units",
             "gemm_tile", "attention_head_dim_rates", "attention_backward_head_dim_rates", "runtime_reserved_bytes",
             "host_op_seconds", "host_launch_seconds", "moe_kernel_seconds", "stream_launch_gap_seconds",
             "fp8_gemm_any_layout", "block_scaled_fp8")
    assert {f: getattr(gb200, f) for f in taken} == {f: getattr(b200, f) for f in taken}
    # the MXFP8 GEMM: the B200's ratio of its measured MXFP8 GEMM to its FP8 MAMF, on the GB200's FP8 MAMF
    ratio = b200.mxfp8_gemm_efficiency / b200.fp8_gemm_efficiency
    assert gb200.mxfp8_gemm_efficiency == pytest.approx(gb200.fp8_gemm_efficiency * ratio, abs=2e-3)
    assert gb200.gpus_per_node == 72 and gb200.collective_ctas_per_card is None


def test_the_gb300_takes_the_gb200s_unmeasured_figures():
    """gb300.yaml takes from gb200.yaml each figure no GB300 source gives -- every GEMM and dispatcher rate but the
    sustained FP8 one (no GB300 MAMF, BF16 GEMM sweep, HybridEP or DeepEP table was found) and what gb200.yaml itself
    takes from b200.yaml: they must follow gb200.yaml when it changes. The GB300's own figures -- peaks, memory,
    fabric, network cards, cuDNN attention (its narrow-head rates included) and the sustained FP8 GEMM rate (below)
    -- are its sources'."""
    gb200 = load_hardware(EXAMPLES / "hardware" / "gb200.yaml")
    gb300 = load_hardware(EXAMPLES / "hardware" / "gb300.yaml")
    taken = ("gemm_efficiency", "fp8_gemm_efficiency", "mxfp8_gemm_efficiency", "gemm_half_intensity",
             "sustained_fraction", "mxfp8_cast_bandwidth_fraction", "compute_units",
             "gemm_tile", "runtime_reserved_bytes", "host_op_seconds", "host_launch_seconds",
             "hybridep_bandwidth_bytes_per_s", "hybridep_rank_latency_s", "deepep_sm_bandwidth_bytes_per_s",
             "moe_kernel_seconds", "stream_launch_gap_seconds", "fp8_gemm_any_layout", "block_scaled_fp8",
             "collective_ctas_per_card", "intra_node_collective_channels")
    assert {f: getattr(gb300, f) for f in taken} == {f: getattr(gb200, f) for f in taken}
    # its own: 284,208 MiB device-reported HBM, one 800 Gb/s ConnectX-8 a GPU, cuDNN 9.22's GB300 attention
    assert gb300.hbm_bytes == 284208 * 2**20 and gb300.inter_node_bandwidth_bytes_per_s == 100e9
    assert gb300.gpus_per_node == 72
    assert gb300.attention_efficiency > gb200.attention_efficiency


# Azure's cuBLASLt FP8 sweep on ND GB300 v6 (egmsft/AI-benchmarking-guide at 18e80a21,
# Azure_Results/ND_GB300_v6_results.md; 10,000 warm-up iterations), TFLOP/s at the shapes that hold the GPU at its
# power limit -- the same benchmark's ND GB200 v6 run is gb200.yaml's set in measurements/gemm.yaml.
GB300_SUSTAINED_FP8 = {(4096, 4096, 4096): 3257.0, (8192, 8192, 8192): 3286.3, (16384, 16384, 16384): 3308.5,
                       (32768, 32768, 32768): 3271.3, (6144, 12288, 12288): 3279.5}


def test_the_gb300s_sustained_fp8_rate_is_the_gb200s_times_the_measured_gain():
    """fp8_sustained_fraction: the GB200's times the geometric mean, over the power-bound shapes, of the GB300's
    sustained cuBLASLt FP8 rate over the GB200's in the same benchmark (1.144: 0.733 -> 0.839). Only the FP8 figure:
    the sweep is FP8, so the BF16 sustained_fraction stays the GB200's (held equal above)."""
    gb200 = load_hardware(EXAMPLES / "hardware" / "gb200.yaml")
    gb300 = load_hardware(EXAMPLES / "hardware" / "gb300.yaml")
    (gb200_sweep,) = [s for s in load_measurements() if s.hardware.name == gb200.name and s.fp8]
    gb200_rates = {(m, n, k): tflops for m, n, k, tflops in gb200_sweep.points}
    ratios = [rate / gb200_rates[shape] for shape, rate in GB300_SUSTAINED_FP8.items()]
    gain = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert gain == pytest.approx(1.144, abs=1e-3) and min(ratios) > 1.13 and max(ratios) < 1.16
    assert gb300.fp8_sustained_fraction == pytest.approx(gb200.fp8_sustained_fraction * gain, abs=1e-3)
    assert gb300.sustained_fraction == gb200.sustained_fraction


def test_default_training_file_spells_out_the_built_in_defaults():
    written = load_training(EXAMPLES / "training" / "default.yaml")
    assert dataclasses.replace(written, source="") == dataclasses.replace(load_training(None), source="")


def test_moe_layer_patterns():
    assert ModelSpec(**SMALL, num_experts=4, moe_layer_freq=2).layer_kinds == ("moe", "dense", "moe", "dense")
    assert ModelSpec(**SMALL, num_experts=4, moe_layer_freq="([0]*1+[1]*3)").layer_kinds == ("dense", "moe", "moe", "moe")
    assert ModelSpec(**SMALL, num_experts=4, moe_layer_freq=(1, 0, 0, 1)).layer_kinds == ("moe", "dense", "dense", "moe")
    assert load_model(EXAMPLES / "models" / "deepseek-v2-lite.yaml").layer_kinds == ("dense",) + ("moe",) * 26


@pytest.mark.parametrize("change, names, words", [
    (dict(hidden_sizee=64), ["hidden_sizee"], "did you mean 'hidden_size'"),
    (dict(num_layers=-2), ["num_layers"], "negative"),
    (dict(num_layers=2.5), ["num_layers"], "not a whole number"),
    (dict(hidden_size=float("nan")), ["hidden_size"], "not a finite number"),
    (dict(seq_length="long"), ["seq_length"], "not a number"),
    (dict(swiglu="yes"), ["swiglu"], "not a boolean"),
    (dict(num_layers=0), ["num_layers"], "at least 1"),
    (dict(normalization="BatchNorm"), ["normalization"], "not one of LayerNorm, RMSNorm"),
    (dict(num_query_groups=3), ["num_attention_heads", "num_query_groups"], "split evenly"),
    (dict(num_experts=4, moe_router_topk=8), ["moe_router_topk", "num_experts"], "more experts than there are"),
    (dict(num_experts=4, moe_layer_freq="([0]*1+[1]*2)"), ["moe_layer_freq", "num_layers"], "3 entries"),
    (dict(num_experts=4, moe_layer_freq="[1]*two"), ["moe_layer_freq"], "cannot read"),
])
def test_bad_model_fields_name_the_file_and_field(change, names, words):
    with pytest.raises(InputError) as err:
        spec_from_mapping(ModelSpec, {**SMALL, **change}, "m.yaml")
    message = str(err.value)
    assert "\n" not in message and words in message
    assert all(f"m.yaml: {name}=" in message for name in names)


def test_missing_required_field_and_vocabulary():
    with pytest.raises(InputError, match="m.yaml: hidden_size=None: required field missing"):
        spec_from_mapping(ModelSpec, {k: v for k, v in SMALL.items() if k != "hidden_size"}, "m.yaml")
    with pytest.raises(InputError, match="vocab_size=None: the vocabulary size is missing"):
        spec_from_mapping(ModelSpec, {k: v for k, v in SMALL.items() if k != "vocab_size"}, "m.yaml")


@given(field=st.sampled_from(["num_layers", "hidden_size", "seq_length", "vocab_size"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not (x >= 0 and x == int(x))
                                                                             if math.isfinite(x) else True),
                       st.integers(max_value=-1), st.booleans(),
                       st.text(max_size=5).filter(lambda t: not (t.isascii() and t.strip().isdigit())), st.none()))
def test_non_counts_are_refused_with_one_line(field, value):
    with pytest.raises(ConfigError) as err:
        spec_from_mapping(ModelSpec, {**SMALL, field: value}, "m.yaml")
    assert f"m.yaml: {field}=" in str(err.value) and "\n" not in str(err.value)


def _incompatible(model_change, training_change):
    model = ModelSpec(**{**SMALL, **model_change}, source="model.yaml")
    training = dataclasses.replace(TrainingSpec(source="train.yaml"), **training_change)
    with pytest.raises(InputError) as err:
        check_compatible(model, training)
    return str(err.value)


def test_inconsistent_model_and_training_name_both_files_and_the_fix():
    heads = _incompatible({}, dict(tensor_model_parallel_size=3))
    assert "model.yaml: num_attention_heads=4" in heads and "train.yaml: tensor_model_parallel_size=3" in heads
    assert "use a TP that divides both (one of 1, 2, 4)" in heads
    layers = _incompatible({}, dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2))
    assert "4 layers cannot fill pp * vpp = 8" in layers and "lower pp or vpp" in layers
    experts = _incompatible(dict(num_experts=6), dict(expert_model_parallel_size=4, data_parallel_size=4,
                                                      global_batch_size=128))
    assert "experts must split evenly over EP ranks" in experts and "one of 1, 2, 3, 6" in experts
    sequence = _incompatible(dict(num_experts=4), dict(tensor_model_parallel_size=2))
    assert "set sequence_parallel: true" in sequence


def test_global_batch_must_split_into_microbatches_per_replica():
    with pytest.raises(InputError) as err:
        TrainingSpec(global_batch_size=100, micro_batch_size=2, data_parallel_size=8, source="t.yaml")
    message = str(err.value)
    assert all(f"t.yaml: {n}=" in message for n in ("global_batch_size", "micro_batch_size", "data_parallel_size"))
    assert "multiple of micro_batch_size * data_parallel_size = 16" in message


def test_recompute_settings_are_checked():
    with pytest.raises(InputError, match="full recompute needs a method and a layer count"):
        TrainingSpec(recompute_granularity="full")
    with pytest.raises(InputError, match=r"\['norms'\] are not modelled"):
        TrainingSpec(recompute_granularity="selective", recompute_modules=("norms",))
    # what published recipes write: recompute_num_layers 0 with selective recompute of layernorm and moe_act
    recipe = TrainingSpec(recompute_granularity="selective", recompute_num_layers=0, recompute_modules=("layernorm", "moe_act"))
    assert recipe.recompute_num_layers is None and recipe.recomputes("moe_act") and recipe.recomputes("layernorm")


def test_bad_hardware_fraction_and_unreadable_files(tmp_path):
    bad = tmp_path / "hw.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load((EXAMPLES / "hardware" / "h100.yaml").read_text()),
                                   "achievable_fraction": 1.5}))
    with pytest.raises(InputError, match=r"hw.yaml: achievable_fraction=1.5: a fraction must be in \[0.001, 1\]"):
        load_hardware(bad)
    with pytest.raises(ConfigError, match="cannot read the model file"):
        load_model(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping of fields"):
        load_model(tmp_path / "list.yaml")


def test_megatron_argument_list_takes_megatron_defaults(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("torchrun pretrain_gpt.py \\\n  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 \\\n"
                      "  --num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 4096 \\\n"
                      "  --max-position-embeddings 4096 --vocab-size 32000 --swiglu --normalization RMSNorm \\\n"
                      "  --disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights \\\n"
                      "  --num-experts 8 --moe-router-topk 2 --micro-batch-size 1 --global-batch-size 256 \\\n"
                      "  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 \\\n"
                      "  --bf16 --use-distributed-optimizer --lr 3e-4 --attention-dropout 0.0 --hidden-dropout 0.0\n")
    model, training = load_megatron_config(script)
    mixtral = load_model(EXAMPLES / "models" / "mixtral-8x7b.yaml")
    differing = {f.name for f in dataclasses.fields(ModelSpec) if getattr(model, f.name) != getattr(mixtral, f.name)}
    assert differing == {"name", "source", "max_position_embeddings", "moe_ffn_hidden_size"}  # spelled differently, same model
    assert model.expert_ffn == mixtral.expert_ffn == 14336
    assert (training.pp, training.ep, training.precision, training.use_distributed_optimizer) == (4, 8, "bf16", True)
    assert training.overlap_grad_reduce is False  # Megatron's default, not the projection's
    _, defaults = from_arguments("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 4 "
                                 "--vocab-size 10 --micro-batch-size 2", "args")
    assert (defaults.precision, defaults.global_batch_size, defaults.pp) == ("fp32", 2, 1)


def test_primus_style_yaml_reads_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"work_group": "x", "modules": {"pre_trainer": {"framework": "megatron", "overrides": {
        "num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128, "vocab_size": 1000,
        "micro_batch_size": 2, "global_batch_size": 32, "num_layers_per_virtual_pipeline_stage": 2,
        "pipeline_model_parallel_size": 2, "bf16": True, "recompute_granularity": "full",
        "recompute_method": "uniform", "recompute_num_layers": 1, "lr": 1e-4}}}}))
    model, training = load_megatron_config(path)
    assert (model.num_layers, training.vpp, training.recompute_granularity, training.precision) == (8, 2, "full", "bf16")


def test_a_bad_layers_per_virtual_stage_is_named():
    with pytest.raises(ConfigError, match="exp: --num-layers-per-virtual-pipeline-stage must be an integer"):
        from_arguments("--num-layers 8 --hidden-size 8 --num-attention-heads 2 --seq-length 4 --vocab-size 10 "
                       "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2.5", "exp")
