"""megatron-core's ``defer_embedding_wgrad_compute``: the output layer's weight-gradient GEMMs leave every
microbatch's backward on the last stage and run once after that rank's last backward, in the pipeline flush;
their inputs stay buffered until then."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from primuspipe.projection.activations import ActivationModel
from primuspipe.projection.compute import Calibration, WorkModel, part_times
from primuspipe.projection.framework import ConfigError
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import read_arguments
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.projection import ProjectionResult, Projector, Refusal, candidates
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


def test_a_deferral_limit_below_the_microbatch_count_is_refused():
    result = Projector(BIG_HEAD, H100).evaluate(dataclasses.replace(DEFERRED, wgrad_deferral_limit=3), "1f1b")
    assert isinstance(result, Refusal) and "only 3 of the step's 8 microbatches is not modelled" in result.error
    assert isinstance(Projector(BIG_HEAD, H100).evaluate(dataclasses.replace(DEFERRED, wgrad_deferral_limit=8), "1f1b"),
                      ProjectionResult)
    with pytest.raises(ConfigError, match="wgrad_deferral_limit=-1: cannot be negative"):
        dataclasses.replace(DEFERRED, wgrad_deferral_limit=-1)


def test_a_search_drops_the_deferral_only_where_there_is_no_pipeline():
    """Megatron refuses it at pp 1, so the searched pp-1 layouts run without it; every other keeps it."""
    searched = list(candidates(BIG_HEAD, DEFERRED, ["1f1b"], search=True))
    assert {t.pp for t, _ in searched} >= {1, 2, 4}
    assert all(t.defer_embedding_wgrad_compute == (t.pp > 1) for t, _ in searched)
