"""``local_batch_size``: a step of several pipeline schedules, one per local batch of each data-parallel replica,
as the trainers on ``torch.distributed.pipelining`` (NeMo AutoModel, torchtitan) run gradient accumulation: each
schedule pays its own warm-up and drain and holds one schedule's activations at its peak."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from published_rows import shipped_runs
from primuspipe.cli import main
from primuspipe.projection.comm import gradient_sync
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.parameters import ParamCount
from primuspipe.projection.projection import ProjectionResult, Projector, candidates
from primuspipe.projection.published import model_of, training_of
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
H100 = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
MODEL = load_model(EXAMPLES / "models" / "llama2-7b.yaml")
# 16 microbatches a replica at pp 4: one schedule of 16, or (local batch 4) four of 4
WHOLE = TrainingSpec(pipeline_model_parallel_size=4, global_batch_size=32, data_parallel_size=2)
FOUR = dataclasses.replace(WHOLE, local_batch_size=4)


def _project(training: TrainingSpec, algorithm: str = "1f1b") -> ProjectionResult:
    result = Projector(MODEL, H100).evaluate(training, algorithm)
    assert isinstance(result, ProjectionResult), result
    return result


def test_the_flush_count_follows_the_local_batch():
    assert (WHOLE.pipeline_flushes, WHOLE.microbatches_per_flush) == (1, 16)
    assert (FOUR.pipeline_flushes, FOUR.microbatches_per_flush) == (4, 4)
    assert dataclasses.replace(WHOLE, local_batch_size=16).pipeline_flushes == 1
    assert FOUR.one_flush().global_batch_size == 8 and FOUR.one_flush().pipeline_flushes == 1


@pytest.mark.parametrize("mbs, local, gbs", [(1, 3, 32), (1, 32, 32), (2, 3, 48)])
def test_a_local_batch_that_does_not_split_the_replicas_share_is_refused(mbs, local, gbs):
    """Not a divisor of the replica's 16 or 24 samples, or not whole microbatches."""
    dataclasses.replace(WHOLE, micro_batch_size=mbs, global_batch_size=gbs, local_batch_size=2 * mbs)  # valid
    with pytest.raises(InputError, match="local_batch_size"):
        dataclasses.replace(WHOLE, micro_batch_size=mbs, global_batch_size=gbs, local_batch_size=local)


@pytest.mark.parametrize("algorithm", ["1f1b", "interleaved-1f1b"])
def test_each_flush_pays_its_own_warm_up_and_drain(algorithm):
    one, four = _project(WHOLE, algorithm), _project(FOUR, algorithm)
    flush = _project(FOUR.one_flush(), algorithm)  # one schedule of 4 microbatches
    assert four.pipeline_flushes == 4 and four.microbatches == 16
    assert four.pipeline_time_s == pytest.approx(4 * flush.pipeline_time_s, rel=1e-9)
    assert four.pipeline_time_s > one.pipeline_time_s * 1.2  # three more bubbles of pp - 1 microbatch slots
    assert four.bubble_rate > one.bubble_rate
    assert four.tokens_per_s_per_gpu == pytest.approx(WHOLE.global_batch_size * MODEL.seq_length
                                                      / four.step_time_s / WHOLE.world_size)


def test_one_flush_holds_one_schedules_activations():
    """1F1B keeps pp microbatches in flight whatever the count: the same peak. GPipe holds every microbatch of
    its schedule, so four schedules of 4 peak at a quarter of one schedule of 16's activations."""
    assert max(_project(FOUR).peak_memory_bytes) == pytest.approx(max(_project(WHOLE).peak_memory_bytes))
    whole, four = _project(WHOLE, "gpipe"), _project(FOUR, "gpipe")
    assert four.memory_breakdown["activations"] == pytest.approx(whole.memory_breakdown["activations"] / 4, rel=0.02)


def test_a_local_batch_of_the_whole_share_is_one_schedule():
    assert _project(dataclasses.replace(WHOLE, local_batch_size=16)) == _project(WHOLE)


def test_unsharded_gradients_are_reduced_once_per_flush():
    """A DDP stage under torch.distributed.pipelining syncs in each schedule's last backward; sharded gradients
    (Megatron-FSDP) are reduced per microbatch already, and keep their price."""
    params = ParamCount(dense=7_000_000_000)
    ddp = TrainingSpec(pipeline_model_parallel_size=1, global_batch_size=64, data_parallel_size=8,
                       use_distributed_optimizer=False)
    for overlap in (False, True):
        plain = dataclasses.replace(ddp, overlap_grad_reduce=overlap)
        flushed = dataclasses.replace(plain, local_batch_size=2)
        once = gradient_sync(params, plain, H100, buckets=32, forward_s=0.01, backward_s=0.02)
        assert once > 0 and gradient_sync(params, flushed, H100, buckets=32, forward_s=0.01, backward_s=0.02) == \
            pytest.approx(4 * once)
    fsdp = dataclasses.replace(ddp, use_distributed_optimizer=True, use_megatron_fsdp=True,
                               data_parallel_sharding_strategy="optim_grads_params")
    assert gradient_sync(params, dataclasses.replace(fsdp, local_batch_size=2), H100, buckets=32) == \
        pytest.approx(gradient_sync(params, fsdp, H100, buckets=32))


def test_the_search_keeps_micro_batches_that_split_the_local_batch():
    training = dataclasses.replace(FOUR, pipeline_model_parallel_size=2, data_parallel_size=4)
    shapes = {(t.micro_batch_size, t.dp) for t, _ in candidates(MODEL, training, ["1f1b"], search=True)}
    assert shapes and all(4 % mbs == 0 and 32 % (4 * dp) == 0 for mbs, dp in shapes)
    assert (4, 4) in shapes and (8, 1) not in shapes


def test_automodels_kimi_k2_runs_two_schedules_of_eight():
    """NeMo AutoModel's benchmark recipe calls ``schedule.step`` once per local batch of 8 (GA 2 at GBS 512 over
    DP 32): the row runs two interleaved schedules of 8 microbatches, not one of 16."""
    run = next(r for r in shipped_runs() if r.id == "automodel-h100-kimi-k2-bf16-256-pp8-vp4-ep32-fsdp")
    training = training_of(run)
    assert (training.pipeline_flushes, training.microbatches_per_flush) == (2, 8)
    model = model_of(run)
    two = Projector(model, H100).evaluate(training, run.algorithm())
    one = Projector(model, H100).evaluate(dataclasses.replace(training, local_batch_size=None), run.algorithm())
    assert two.pipeline_flushes == 2 and two.step_time_s > one.step_time_s and two.bubble_rate > one.bubble_rate


def test_the_report_and_the_json_name_the_schedules(capsys, tmp_path):
    training = tmp_path / "t.yaml"
    training.write_text("pipeline_model_parallel_size: 4\nglobal_batch_size: 32\nlocal_batch_size: 8\n")
    args = ["project", "--model", str(EXAMPLES / "models" / "llama2-7b.yaml"), "--hardware",
            str(EXAMPLES / "hardware" / "h100.yaml"), "--training", str(training), "-a", "1f1b"]
    assert main(args) == 0
    assert "each with its own warm-up and drain: 4 of 8 microbatches" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert (row["pipeline_flushes"], row["microbatches"]) == (4, 32)
