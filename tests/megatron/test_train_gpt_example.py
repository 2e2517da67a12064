"""examples/train_gpt.py as a user runs it (torchrun, CPU/gloo): Megatron's flag names, an uneven layer
split that trains and matches Megatron's schedule bitwise, and a pp=1 reference where Megatron's own
schedule refuses the shape."""

import gc
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


def test_manual_gc_turns_the_collector_off_and_collects_between_steps(monkeypatch):
    """Megatron-LM's --manual-gc: no automatic collection inside the loop, one every N-th step, the
    collector restored after; a negative interval is refused by name."""
    from primuspipe.testing.megatron.compare import manual_gc

    collected = []
    monkeypatch.setattr(gc, "collect", lambda *_: collected.append(1) or 0)
    assert gc.isenabled()
    with manual_gc(2) as step_done:
        assert not gc.isenabled()
        for step in range(5):
            step_done(step)
    assert gc.isenabled() and len(collected) == 3  # on entry, after steps 1 and 3
    with manual_gc(0) as step_done:
        step_done(0)
        assert not gc.isenabled()
    with manual_gc(None) as step_done:
        step_done(0)
        assert gc.isenabled()
    assert len(collected) == 4
    example = _example()
    assert example.parse_args(["--pp", "2", "--microbatches", "2", "--manual-gc"]).manual_gc_interval == 0
    with pytest.raises(SystemExit):
        example.parse_args(["--pp", "2", "--microbatches", "2", "--manual-gc", "--manual-gc-interval", "-1"])


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


def test_megatron_lm_optimizer_checkpoint_and_split_flags(capsys):
    example = _example()
    args = example.parse_args(["--pp", "2", "--microbatches", "4", "--optimizer", "adam", "--use-distributed-optimizer",
                               "--overlap-grad-reduce", "--overlap-param-gather", "--save", "a", "--load", "b",
                               "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                               "--expert-tensor-parallel-size", "2", "--mtp-num-layers", "1"])
    assert (args.optimizer, args.use_distributed_optimizer, args.overlap_grad_reduce, args.overlap_param_gather) == \
        ("adam", True, True, True)
    assert (args.save, args.load, args.expert_tensor_parallel_size, args.mtp_num_layers) == ("a", "b", 2, 1)
    assert args.account_for_embedding_in_pipeline_split and args.account_for_loss_in_pipeline_split
    for flags, why in ((["--overlap-param-gather"], "needs --use-distributed-optimizer and --overlap-grad-reduce"),
                       (["--use-distributed-optimizer"], "needs --optimizer adam")):
        with pytest.raises(SystemExit):
            example.parse_args(["--pp", "2", "--microbatches", "4", *flags])
        assert why in capsys.readouterr().err


DISTRIBUTED = ("--optimizer", "adam", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")


@pytest.mark.slow
def test_save_under_zbv_load_under_1f1b_continues_the_loss_curve(tmp_path):
    """Four iterations under zbv, against two under zbv saved and continued under 1f1b from the checkpoint:
    the same per-iteration losses, and the resumed run equals Megatron's own 1f1b from that checkpoint."""
    common = ("--pp", "2", "--microbatches", "4", *DISTRIBUTED)
    uninterrupted, _ = _torchrun(4, *common, "--pp-algorithm", "zbv", "--iterations", "4")
    saved, _ = _torchrun(4, *common, "--pp-algorithm", "zbv", "--iterations", "2", "--save", str(tmp_path / "ckpt"))
    resumed, _ = _torchrun(4, *common, "--pp-algorithm", "1f1b", "--iterations", "4", "--load", str(tmp_path / "ckpt"),
                           "--compare-native")
    assert saved["losses"] == uninterrupted["losses"][:2]
    assert resumed["first_iteration"] == 2 and resumed["losses"] == uninterrupted["losses"][2:]
    assert resumed["reference"].startswith("Megatron's own schedule") and resumed["max_abs_grad_diff"] == 0.0


@pytest.mark.slow
def test_v_min_with_uneven_first_and_last_stage():
    """The V's first and last stage take --decoder-first/last-pipeline-num-layers (2 + 6x1 + 2 layers at
    pp=4); Megatron refuses that split for its interleaved placement, so the reference is pp=1."""
    result, log = _torchrun(4, "--pp", "4", "--microbatches", "8", "--pp-algorithm", "v-min", "--num-layers", "10",
                            "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2",
                            "--untie-embeddings-and-output-weights", "--iterations", "2", "--compare-native")
    assert result["placement"] == "v" and result["reference"].startswith("pp=1")
    assert result["loss"] == result["native_loss"] and result["max_abs_grad_diff"] == 0.0


@pytest.mark.slow
def test_bf16_v_on_cpu_matches_megatron():
    """--bf16 on CPU (gloo) with a V table and the distributed optimizer: Float16Module casts at the V's
    ends (a middle chunk's fp32 output had been sent where bf16 was received, and gloo aborted)."""
    result, _ = _torchrun(2, "--pp", "2", "--microbatches", "4", "--pp-algorithm", "zbv", "--iterations", "2",
                          "--bf16", "--optimizer", "adam", "--use-distributed-optimizer", "--overlap-grad-reduce",
                          "--overlap-param-gather", "--compare-native")
    assert result["placement"] == "v" and result["reference"] == "Megatron's own schedule, pp=2, vpp=2"
    assert result["loss"] == result["native_loss"] and result["max_abs_grad_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("pp, emulation", [(2, "pair"), (4, "group")])
def test_auto_replan_switches_and_trains_as_the_new_schedule(pp, emulation, monkeypatch):
    """A 1F1B run told to choose among the split-backward schedules (so it always switches) under the NCCL
    emulator: the JSON line reports the switch and its prediction, and every iteration's loss is the one a
    run of the chosen schedule from the start gives (the probe and the switch change no gradient)."""
    monkeypatch.setenv("PRIMUSPIPE_NCCL_EMULATION", emulation)
    monkeypatch.setenv("PRIMUSPIPE_AUTO_REPLAN_WARMUP", "1")
    monkeypatch.setenv("PRIMUSPIPE_AUTO_REPLAN_STEPS", "2")
    monkeypatch.setenv("PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS", "zb-h1,zb-h2")
    flags = ("--pp", str(pp), "--num-layers", str(2 * pp), "--microbatches", str(2 * pp), "--iterations", "5")
    gc_flags = ("--manual-gc", "--manual-gc-interval", "2") if pp == 2 else ()  # no numerics change, either way
    result, log = _torchrun(pp, *flags, *gc_flags, "--pp-algorithm", "1f1b", "--auto-replan")
    assert result["replanned_to"] in ("zb-h1", "zb-h2")
    assert f"switching 1f1b -> {result['replanned_to']}, predicted step" in log
    assert result["predicted_step_time_s"] > 0 and result["step_time_s"] > 0 and "prediction_error" in result
    monkeypatch.delenv("PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS")
    reference, _ = _torchrun(pp, *flags, "--pp-algorithm", result["replanned_to"])
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_long_run_does_not_grow_its_memory_step_by_step(tmp_path):
    """The example's steps start at the same resident memory: the harness keeps the first step's gradients only
    (it kept every step's, a model's worth a step -- 13 MB here -- which slowed a pp = 4 run's later backwards
    by 5-15 % and made the re-planner's prediction from the early steps miss them)."""
    _torchrun(2, "--pp", "2", "--microbatches", "4", "--pp-algorithm", "1f1b", "--iterations", "12", "--hidden-size",
              "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "4", "--seq-length", "64",
              "--micro-batch-size", "4", "--num-layers", "4", "--vocab-size", "512", "--manual-gc",
              "--manual-gc-interval", "1", "--dump-dir", str(tmp_path))
    for rank in (0, 1):
        start = [json.loads((tmp_path / f"iter_{i:06d}" / f"rank_{rank}.json").read_text())["meta"]["memory_at_start"]
                 for i in range(3, 12)]
        assert max(start) - min(start) < 20 * 2**20, f"rank {rank}: {[s >> 20 for s in start]} MiB at the steps' starts"
