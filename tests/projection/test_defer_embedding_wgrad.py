"""megatron-core's ``defer_embedding_wgrad_compute``: the output layer's weight-gradient GEMMs leave every
microbatch's backward on the last stage and run once after that rank's last backward, in the pipeline flush;
their inputs stay buffered until then."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from published_rows import shipped_runs
from primuspipe.projection.activations import ActivationModel
from primuspipe.projection.compute import Calibration, WorkModel, part_times
from primuspipe.projection.framework import ConfigError
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import read_arguments
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.projection import ProjectionResult, Projector, candidates
from primuspipe.projection.published import project_run
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
H100 = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
# a 256k vocabulary (Nemotron-4's) on a 7B body: the head outweighs a stage's layers, the last stage binds
BIG_HEAD = dataclasses.replace(load_model(EXAMPLES / "models" / "llama2-7b.yaml"), vocab_size=256_000)
PLAIN = TrainingSpec(pipeline_model_parallel_size=4, global_batch_size=8, cross_entropy_loss_fusion=True)
DEFERRED = dataclasses.replace(PLAIN, defer_embedding_wgrad_compute=True)


def _project(training: TrainingSpec) -> ProjectionResult:
    result = Projector(BIG_HEAD, H100).evaluate(training, "1f1b")
    assert isinstance(result, ProjectionResult), result
    return result


def test_the_megatron_flag_is_modelled_not_refused():
    args = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1000 --micro-batch-size 1 --global-batch-size 16 --bf16 --pipeline-model-parallel-size 2 ")
    read = read_arguments(args + "--defer-embedding-wgrad-compute --wgrad-deferral-limit 22", "run.sh")
    assert read.training.defer_embedding_wgrad_compute and read.training.wgrad_deferral_limit == 22
    assert "defer_embedding_wgrad_compute" not in read.no_effect


def _saved(global_batch_size: int) -> tuple[float, float]:
    """Seconds the deferral takes off the pipeline, and the step's whole head weight-gradient time."""
    plain = dataclasses.replace(PLAIN, global_batch_size=global_batch_size)
    head_w = part_times(WorkModel(BIG_HEAD, plain), H100, Calibration())["head"].backward_weight
    deferred = dataclasses.replace(plain, defer_embedding_wgrad_compute=True)
    return _project(plain).pipeline_time_s - _project(deferred).pipeline_time_s, head_w * plain.microbatches


def test_the_flush_hides_the_last_stages_head_weight_gradients():
    """1F1B, last stage bound: each of its microbatches loses the head's W, which runs after its last backward
    while the other ranks finish theirs. With few microbatches the flush hides all of it; with many, only
    as much as the flush is long (the same at any count), the rest added at the step's end."""
    saved, whole = _saved(8)
    assert saved == pytest.approx(whole, rel=1e-6)
    flush, _ = _saved(16)
    saved, whole = _saved(32)
    assert saved == pytest.approx(flush, rel=1e-6) and saved < whole / 2


def test_the_buffered_inputs_and_gradients_count_on_the_head_rank():
    """Every microbatch's output-layer input and output gradient stay until the drain: the head rank's peak
    rises by the step's buffer, the others' not at all."""
    plain, deferred = _project(PLAIN), _project(DEFERRED)
    buffer = ActivationModel(BIG_HEAD, PLAIN).head_gemm_bytes() * PLAIN.microbatches
    rises = [d - p for d, p in zip(deferred.peak_memory_bytes, plain.peak_memory_bytes)]
    assert rises[-1] == pytest.approx(buffer, rel=1e-6)
    assert rises[:-1] == pytest.approx([0.0] * 3, abs=1.0)


@pytest.mark.parametrize("change", [dict(pipeline_model_parallel_size=1),
                                    dict(gradient_accumulation_fusion=False)])
def test_megatrons_preconditions_are_enforced_in_one_line(change):
    with pytest.raises(InputError, match="defer_embedding_wgrad_compute=True.*needs a pipeline and gradient "
                                         "accumulation fusion") as caught:
        dataclasses.replace(DEFERRED, **change)
    assert "\n" not in str(caught.value)


def test_a_limit_below_the_microbatch_count_defers_only_the_first_microbatches():
    """megatron-core buffers the first ``wgrad_deferral_limit`` microbatches and runs every later one's GEMM in its
    own backward: the step lies between none and every one deferred, the drain is the limit's head Ws, and the
    buffer the limit's inputs and gradients. A limit at the count or above is the full deferral."""
    plain, every = _project(PLAIN), _project(DEFERRED)
    part = _project(dataclasses.replace(DEFERRED, wgrad_deferral_limit=3))
    assert every.pipeline_time_s < part.pipeline_time_s < plain.pipeline_time_s
    buffer = ActivationModel(BIG_HEAD, PLAIN).head_gemm_bytes()
    assert part.peak_memory_bytes[-1] - plain.peak_memory_bytes[-1] == pytest.approx(3 * buffer, rel=1e-6)
    assert _project(dataclasses.replace(DEFERRED, wgrad_deferral_limit=8)) == every
    with pytest.raises(ConfigError, match="wgrad_deferral_limit=-1: negative"):
        dataclasses.replace(DEFERRED, wgrad_deferral_limit=-1)


@pytest.mark.parametrize("algorithm,vpp,limit", [("1f1b", 1, 40), ("1f1b", 1, 56), ("interleaved-1f1b", 2, 40),
                                                 ("zb-h1", 1, 40)])
def test_a_shorter_pipeline_stands_for_a_partial_deferral_exactly(algorithm, vpp, limit):
    """A long pipeline is simulated at shorter counts and carried on along a line; under a partial deferral each
    shorter count keeps the step's undeferred last microbatches and leaves out deferred ones only, so the line
    gives what the whole step's simulation gives. Without that (the limit kept, or every microbatch deferred in
    the shorter ones) it would not: the full deferral's step is checked to differ."""
    training = dataclasses.replace(DEFERRED, global_batch_size=64, wgrad_deferral_limit=limit,
                                   virtual_pipeline_model_parallel_size=vpp)
    projector = Projector(BIG_HEAD, H100)
    carried = projector._carried_on(training, algorithm)
    assert carried is not None, "64 microbatches at pp 4 are carried on from shorter pipelines"
    whole = projector._pipeline(training, algorithm, 64)[2]
    assert carried[2].step_time == pytest.approx(whole.step_time, rel=1e-9)
    assert carried[2].peak_memory_bytes == pytest.approx(whole.peak_memory_bytes, rel=1e-9)
    every = projector._pipeline(dataclasses.replace(training, wgrad_deferral_limit=0), algorithm, 64)[2]
    assert every.step_time < whole.step_time * (1 - 1e-3)


def test_a_partial_deferral_whose_undeferred_tail_outgrows_the_shorter_counts_is_simulated_whole():
    """9 of 64 deferred leaves 55 at the end, more than the shorter counts (16, 24) hold beside deferred ones."""
    training = dataclasses.replace(DEFERRED, global_batch_size=64, wgrad_deferral_limit=9)
    assert Projector(BIG_HEAD, H100)._carried_on(training, "1f1b") is None
    assert _project(training).simulated_microbatches == ()


def test_a_search_drops_the_deferral_only_where_there_is_no_pipeline():
    """Megatron refuses it at pp 1, so the searched pp-1 layouts run without it; every other keeps it."""
    searched = list(candidates(BIG_HEAD, DEFERRED, ["1f1b"], search=True))
    assert {t.pp for t, _ in searched} >= {1, 2, 4}
    assert all(t.defer_embedding_wgrad_compute == (t.pp > 1) for t, _ in searched)


NEMO2502_RECIPE_LIMITS = {"llama3-70b": 22, "llama3.1-405b": 50, "nemotron4-340b": 22, "gpt3-175b": 50}
"""``wgrad_deferral_limit`` of NeMo's recipes at the 25.02 release (NVIDIA/NeMo c80bd5c0c6,
``nemo/collections/llm/recipes/{llama3_70b,llama31_405b,nemotron4_340b,gpt3_175b}.py``,
``pretrain_performance_optimizations``), whose performance scripts keep the callback's deferral."""


def test_the_nemo_2502_rows_defer_as_their_recipes_set_it():
    """Every pipelined row of NeMo 25.02's performance summary (B200 and H100) ran a recipe in performance mode whose
    MegatronCommOverlapCallback defers the output layer's weight gradients, so each carries the deferral with its
    recipe's limit, and the deferral is what the projection prices: without it the step is longer (the head's W is
    back in the last stage's backward instead of in the flush)."""
    rows = [r for r in shipped_runs() if r.id.startswith("nemo2502-") and r.training.get("pipeline_model_parallel_size", 1) > 1]
    assert {r.id for r in rows} >= {"nemo2502-b200-llama3-70b-fp8-64", "nemo2502-b200-gpt3-175b-fp8-512",
                                    "nemo2502-h100-gpt3-175b-fp8-512"}
    for run in rows:
        assert run.training.get("defer_embedding_wgrad_compute") is True, run.id
        assert run.training.get("wgrad_deferral_limit") == NEMO2502_RECIPE_LIMITS[run.model], run.id
    run = next(r for r in rows if r.id == "nemo2502-b200-llama3-70b-fp8-64")
    plain = {k: v for k, v in run.training.items() if k not in ("defer_embedding_wgrad_compute", "wgrad_deferral_limit")}
    deferred, undeferred = project_run(run), project_run(dataclasses.replace(run, training=plain))
    assert deferred["step_time_s"] < undeferred["step_time_s"]


NEMO2412_LAUNCHER_LIMITS = {"nemo2412-llama3-70b-fp8-64": 22, "nemo2412-gpt3-175b-fp8-128": None,
                            "nemo2412-gpt3-175b-fp8-512": None}
"""The NeMo 24.12 summary's pipelined rows whose launcher config decides the deferral (measured on NeMo 24.07 with
NVIDIA/NeMo-Framework-Launcher's configs): ``llama/llama3_70b.yaml`` has the table's VP 5 only from fee1762f on, and
there ``wgrad_deferral_limit: 22`` beside it; ``gpt3/175b.yaml`` sets no deferral at any commit, and NeMo 1 defaults
it off. The Llama 2 70B and Nemotron rows are left out: no launcher commit has both their VP and a deferral."""


def test_the_nemo_2412_rows_defer_as_their_launcher_configs_set_it():
    rows = {r.id: r for r in shipped_runs() if r.id in NEMO2412_LAUNCHER_LIMITS}
    assert rows.keys() == NEMO2412_LAUNCHER_LIMITS.keys()
    for row_id, limit in NEMO2412_LAUNCHER_LIMITS.items():
        training = rows[row_id].training
        assert training.get("defer_embedding_wgrad_compute", False) is (limit is not None), row_id
        assert training.get("wgrad_deferral_limit") == limit, row_id
