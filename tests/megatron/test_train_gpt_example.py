"""examples/train_gpt.py as a user runs it (torchrun, CPU/gloo): Megatron's flag names, an uneven layer
split that trains and matches Megatron's schedule bitwise, and a pp=1 reference where Megatron's own
schedule refuses the shape."""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatron_flag_names_and_uneven_split():
    example = _example()
    args = example.parse_args(["--pipeline-model-parallel-size", "3", "--microbatches", "3", "--num-layers", "7",
                               "--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "4",
                               "--expert-model-parallel-size", "2", "--recompute-granularity", "selective",
                               "--recompute-modules", "core_attn", "moe", "--calculate-per-token-loss"])
    assert (args.pp, args.tensor_model_parallel_size, args.sequence_parallel, args.num_experts) == (3, 2, True, 4)
    assert not args.untie_embeddings_and_output_weights and args.gradient_accumulation_fusion, "Megatron's defaults"
    assert example.uneven_split(7, 3) == (2, 2) and example.uneven_split(7, 2) == (4, 3)
    assert example.uneven_split(10, 4) == (2, 2)  # 2 + 3 + 3 + 2


def _torchrun(nproc: int, *flags: str) -> tuple[dict, str]:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([torchrun, "--nproc-per-node", str(nproc), str(EXAMPLE), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_uneven_pipeline_trains_and_matches_megatron():
    result, log = _torchrun(3, "--pp", "3", "--num-layers", "7", "--microbatches", "3", "--pp-algorithm", "zb-h1",
                            "--iterations", "2", "--compare-native")
    assert "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2" in log
    assert result["reference"].startswith("Megatron's own schedule")
    assert result["max_abs_grad_diff"] == 0.0 and result["loss"] == result["native_loss"]


@pytest.mark.slow
def test_falls_back_to_pp1_where_megatron_refuses_the_shape():
    result, log = _torchrun(2, "--pp", "2", "--microbatches", "3", "--pp-algorithm", "zbv", "--iterations", "2",
                            "--compare-native")
    assert result["placement"] == "v" and result["reference"].startswith("pp=1 (Megatron's own schedule refuses")
    assert "comparing with a pp=1 run instead" in log
    assert result["max_abs_grad_diff"] <= 1e-6 and abs(result["loss"] - result["native_loss"]) <= 1e-6
