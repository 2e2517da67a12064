"""``primuspipe project``: the JSON contract scripts rely on, the help text, errors as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primuspipe.cli import main
from primuspipe.projection.hardware_spec import load_hardware

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
MODEL = str(EXAMPLES / "models" / "llama2-7b.yaml")
HARDWARE = str(EXAMPLES / "hardware" / "mi300x.yaml")
ROW_KEYS = {"algorithm", "pp", "vpp", "micro_batch_size", "step_time_s", "bubble_rate", "peak_memory_bytes",
            "tokens_per_s_per_gpu", "mfu", "verdict"}


def _json(capsys, *args) -> dict:
    assert main(["project", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_contract_without_a_training_file(capsys):
    out = _json(capsys, "--model", MODEL, "--hardware", HARDWARE, "-a", "1f1b", "-a", "zbv")
    assert [r["algorithm"] for r in out["results"]] in (["1f1b", "zbv"], ["zbv", "1f1b"])
    for row in out["results"]:
        assert ROW_KEYS <= set(row) and len(row["peak_memory_bytes"]) == 4
        assert row["verdict"] in ("FITS", "AT-RISK", "OOM")
    assert out["parameters"]["total"] == 6_738_415_616 and len(out["parameters"]["per_rank"]) == 4
    assert set(out["memory"]) == {"dense"} and "moe_small_kernels" not in out
    assert set(out["memory"]["dense"]) == {"input_norm", "attention", "pre_mlp_norm", "mlp"}


def test_moe_memory_per_layer_kind_and_overrides(capsys):
    out = _json(capsys, "--model", str(EXAMPLES / "models" / "deepseek-v2-lite.yaml"), "--hardware",
                str(EXAMPLES / "hardware" / "h200.yaml"), "--training", str(EXAMPLES / "training" / "deepseek-v2-lite.yaml"),
                "--pp", "3", "--micro-batch-size", "2", "-a", "1f1b")
    assert set(out["memory"]) == {"dense", "moe"} and {"router", "moe_mlp"} <= set(out["memory"]["moe"])
    assert (out["results"][0]["pp"], out["results"][0]["micro_batch_size"]) == (3, 2)
    small = out["moe_small_kernels"]  # shown: what the fitted per-kernel cost adds to one MoE layer
    h200 = load_hardware(EXAMPLES / "hardware" / "h200.yaml")
    each = h200.moe_kernel_seconds + h200.stream_launch_gap_seconds  # no CUDA graphs: each kernel launched into a stream
    assert small["seconds"] == pytest.approx([n * each for n in small["kernels"]]) and min(small["kernels"]) > 0


def test_target_nodes_and_search(capsys):
    out = _json(capsys, "--model", MODEL, "--hardware", HARDWARE, "--target-nodes", "1", "--search", "-a", "1f1b")
    assert out["gpus"] == 8
    assert {(r["pp"], r["micro_batch_size"]) for r in out["results"]} >= {(1, 1), (2, 2), (8, 8)}


def test_table_output(capsys):
    assert main(["project", "--model", MODEL, "--hardware", HARDWARE, "-a", "1f1b", "-a", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "llama2-7b on 4 x MI300X" in out and "1f1b" in out and "OOM" in out


def test_help_explains_inputs_thresholds_and_examples(capsys):
    with pytest.raises(SystemExit):
        main(["project", "--help"])
    text = capsys.readouterr().out
    for words in ("--model", "--training", "--hardware", "--megatron-config", "OOM when", "AT-RISK within",
                  "--target-nodes", "--search", "--benchmark-layers", "examples:"):
        assert words in text


def test_errors_are_one_line_with_status_1(capsys, tmp_path):
    training = tmp_path / "t.yaml"
    training.write_text("tensor_model_parallel_size: 3\n")
    assert main(["project", "--model", MODEL, "--hardware", HARDWARE, "--training", str(training)]) == 1
    err = capsys.readouterr().err
    assert "num_attention_heads=32" in err and "tensor_model_parallel_size=3" in err
    assert main(["project", "--hardware", HARDWARE]) == 1
    assert "--model FILE" in capsys.readouterr().err


@pytest.mark.slow
def test_benchmark_layers_calibrates_from_this_host(capsys, tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text("name: tiny\nnum_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\n"
                     "vocab_size: 256\nmake_vocab_size_divisible_by: 1\n")
    training = tmp_path / "fp32.yaml"
    training.write_text("pipeline_model_parallel_size: 2\nprecision: fp32\n")  # CPU kernels are fastest in fp32
    out = _json(capsys, "--model", str(model), "--training", str(training), "--hardware", HARDWARE, "--benchmark-layers",
                "-a", "1f1b")
    assert out["calibration"].startswith("layer benchmark (CPU") and out["results"][0]["step_time_s"] > 0


def test_zb_auto_picks_a_table_that_fits_by_the_verdicts_own_count(capsys):
    # Llama 3 70B at TP 8 with sequence parallelism on H100: a split B's rise and what W keeps beyond the stage's
    # activations put ZB-H1 over HBM; zb-auto budgets the same bytes the verdict counts, so its own table (not a
    # fixed one it keeps) fits with the risk margin to spare (before, its unit budget picked an 82.1 GiB table)
    hardware = EXAMPLES / "hardware" / "h100.yaml"
    out = _json(capsys, "--model", str(EXAMPLES / "models" / "llama3-70b.yaml"), "--hardware", str(hardware),
                "--training", str(EXAMPLES / "training" / "llama3-70b.yaml"), "-a", "zb-auto", "-a", "zb-h1")
    rows = {r["algorithm"]: r for r in out["results"]}
    assert rows["zb-h1"]["verdict"] == "OOM"
    assert rows["zb-auto"]["verdict"] == "FITS" and not rows["zb-auto"]["note"]
    assert max(rows["zb-auto"]["peak_memory_bytes"]) <= load_hardware(hardware).hbm_bytes * 0.9


@pytest.mark.parametrize("option, folder", [("--model", "models"), ("--hardware", "hardware"),
                                            ("--training", "training")])
def test_a_missing_input_file_points_at_the_shipped_ones(capsys, option, folder):
    """A bare name (``--hardware h100``) is a new user's likeliest first mistake: the one line says where the
    repository's files are, with an example path that exists."""
    given = {"--model": MODEL, "--hardware": HARDWARE, option: "h100"}
    assert main(["project", *(x for pair in given.items() for x in pair)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "h100: it does not exist" in err
    example = err.rsplit(f"{option} ", 1)[1].rstrip(")")
    assert f"examples/projection/{folder}/*.yaml" in err and (EXAMPLES.parents[1] / example).is_file()


def test_pp_and_vpp_answer_to_megatrons_names(capsys):
    ours = _json(capsys, "--model", MODEL, "--hardware", HARDWARE, "-a", "interleaved-1f1b", "--pp", "2", "--vpp", "2")
    megatron = _json(capsys, "--model", MODEL, "--hardware", HARDWARE, "-a", "interleaved-1f1b",
                     "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2")
    assert (megatron["results"][0]["pp"], megatron["results"][0]["vpp"]) == (2, 2)
    assert megatron["results"] == ours["results"]
