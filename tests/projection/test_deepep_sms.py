"""DeepEP's intranode calls move rows with the SMs (compute units) they hold: a flex-dispatcher call on DeepEP inside
one node takes the longer of the fabric's time and its rows over ``SMs x deepep_sm_bandwidth_bytes_per_s``.

Held against DeepEP's published B200 sweep (deepseek-ai/DeepEP branch hybrid-ep, docs/README_Hybrid-EP.md: 4,096
tokens of 7,168, top-8 of 64 experts at random, 8 ranks, BF16, "Torch API" bandwidth by SM count), on generated
layouts (SMs, EP, token counts, hardware) for the rule itself, and on Primus-Turbo's ``turbo_deepep_num_cu``, which
is the dispatcher's SM count where Primus's DeepEP runs."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from published_rows import shipped_runs
from primuspipe.projection.comm import Collectives, destination_ranks, layer_comm
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import read_arguments
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
HARDWARE = {name: load_hardware(EXAMPLES / "hardware" / f"{name}.yaml") for name in ("b200", "h100", "mi355x")}
QWEN3 = load_model(EXAMPLES / "models" / "qwen3-30b-a3b.yaml")
SWEEP_MODEL = dataclasses.replace(QWEN3, hidden_size=7168, num_experts=64, moe_router_topk=8)
"""The sweep's shape: rows of 7,168 BF16 values, top-8 of 64 experts (8 a rank at EP 8), random picks."""
B200_DEEPEP_SWEEP = {16: (348, 302), 24: (494, 420), 28: (560, 477), 32: (619, 524)}
"""SMs -> (dispatch, combine) GB/s, BF16, DeepEP's Torch-API rows of the B200 table (its linear range)."""


def _deepep(ep: int, sms: int, mbs: int = 1, **fields) -> TrainingSpec:
    return TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=ep, data_parallel_size=ep,
                        global_batch_size=ep * mbs, micro_batch_size=mbs, moe_token_dispatcher_type="flex",
                        moe_flex_dispatcher_num_sms=sms, **fields)


def _rows(model, training: TrainingSpec) -> float:
    """Bytes a rank receives in a dispatch: one BF16 row per token and destination rank, its own included."""
    tokens = training.micro_batch_size * model.seq_length
    return tokens * destination_ranks(model, training) * model.hidden_size * 2


@pytest.mark.parametrize("sms", sorted(B200_DEEPEP_SWEEP))
def test_deepep_on_b200_runs_at_its_published_bandwidth_for_the_sms_it_holds(sms):
    """The call's algorithm bandwidth lies between the measured combine and dispatch at every SM count of the
    sweep's linear range (the fabric's 900 GB/s x 0.8 alone gave 720 GB/s at all of them)."""
    training = _deepep(8, sms)
    call = layer_comm(SWEEP_MODEL, training, HARDWARE["b200"], "moe").ep[0] / 2
    dispatch, combine = B200_DEEPEP_SWEEP[sms]
    assert combine * 0.99e9 <= _rows(SWEEP_MODEL, training) / call <= dispatch * 1.01e9


def _generated_cases(n: int = 40):
    rng = random.Random(26)
    for _ in range(n):
        hardware = HARDWARE[rng.choice(sorted(HARDWARE))]
        rate = rng.choice([None, rng.uniform(1e9, 40e9)])
        yield (dataclasses.replace(hardware, deepep_sm_bandwidth_bytes_per_s=rate), rng.choice([2, 4, 8]),
               rng.randint(1, 200), rng.choice([1, 2, 4, 12]))


@pytest.mark.parametrize(("hardware", "ep", "sms", "mbs"), list(_generated_cases()))
def test_a_deepep_call_takes_the_longer_of_the_fabric_and_its_sms(hardware, ep, sms, mbs):
    training = _deepep(ep, min(sms, hardware.compute_units - 1), mbs)
    fabric_only = dataclasses.replace(hardware, deepep_sm_bandwidth_bytes_per_s=None)
    rows = _rows(QWEN3, training)
    fabric = Collectives(fabric_only).all_to_all(rows, ep, ep)
    rate = hardware.deepep_sm_bandwidth_bytes_per_s
    expected = max(fabric, rows / (training.dispatcher_sms * rate)) if rate else fabric
    assert layer_comm(QWEN3, training, hardware, "moe").ep[0] == pytest.approx(2 * expected)
    assert layer_comm(QWEN3, training, fabric_only, "moe").ep[0] == pytest.approx(2 * fabric)
    more = dataclasses.replace(training, moe_flex_dispatcher_num_sms=training.dispatcher_sms + 1)
    assert layer_comm(QWEN3, more, hardware, "moe").ep[0] <= layer_comm(QWEN3, training, hardware, "moe").ep[0]
    # the rule is DeepEP's inside a node: the all-to-all dispatcher, HybridEP and a group across nodes keep theirs
    for other in (dataclasses.replace(training, moe_token_dispatcher_type="alltoall"),
                  dataclasses.replace(training, moe_flex_dispatcher_backend="hybridep"),
                  dataclasses.replace(training, expert_model_parallel_size=2 * hardware.gpus_per_node,
                                      data_parallel_size=2 * hardware.gpus_per_node,
                                      global_batch_size=2 * hardware.gpus_per_node * mbs)):
        assert layer_comm(QWEN3, other, hardware, "moe").ep == layer_comm(QWEN3, other, fabric_only, "moe").ep


def test_primus_turbo_deepep_runs_on_turbo_deepep_num_cu():
    """Primus's DeepEP holds ``turbo_deepep_num_cu`` units (Primus's default 32), whatever megatron-core's SM setting
    says, and ``--turbo_deepep_num_cu`` in a Primus run's arguments sets it (it was set aside before)."""
    primus = dict(enable_primus_turbo=True, use_turbo_deepep=True, moe_router_dtype="fp32")
    default = dataclasses.replace(_deepep(8, 20), **primus)
    assert default.dispatcher_sms == 32
    for cu in (16, 64, 80):
        assert dataclasses.replace(default, turbo_deepep_num_cu=cu).dispatcher_sms == cu
    mi355x = HARDWARE["mi355x"]
    fewer, more = (layer_comm(QWEN3, dataclasses.replace(default, turbo_deepep_num_cu=cu), mi355x, "moe").ep[0]
                   for cu in (32, 64))
    assert fewer == pytest.approx(2 * more)  # bound by its units on MI355X at both counts
    args = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1000 --num-experts 16 --moe-router-topk 4 --micro-batch-size 1 --global-batch-size 8 --bf16 "
            "--expert-model-parallel-size 8 --enable_primus_turbo True --use_turbo_deepep True --moe_router_dtype fp32 "
            "--turbo_deepep_num_cu 64")
    config = read_arguments(args, "run.sh")
    assert config.training.turbo_deepep_num_cu == 64 and config.training.dispatcher_sms == 64
    assert "turbo_deepep_num_cu" not in config.no_effect
    with pytest.raises(InputError, match="turbo_deepep_num_cu"):
        dataclasses.replace(default, turbo_deepep_num_cu=0)
    with pytest.raises(InputError, match="deepep_sm_bandwidth_bytes_per_s"):
        dataclasses.replace(mi355x, deepep_sm_bandwidth_bytes_per_s=0)


def test_every_published_primus_deepep_row_says_its_compute_units():
    """A row says what ran: the CU count bounds DeepEP's speed, so a Primus DeepEP row states the one its script or
    recipe passed rather than taking Primus's default."""
    rows = [r for r in shipped_runs() if r.training.get("use_turbo_deepep")]
    assert rows
    assert all("turbo_deepep_num_cu" in r.training for r in rows), [r.id for r in rows if "turbo_deepep_num_cu" not in r.training]
