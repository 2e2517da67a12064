"""The flex dispatcher under the EP overlap holds SMs (DeepEP 20, HybridEP 24 by default): the compute beside its
kernels runs on the rest, so the overlapped share of a pass takes longer; without the overlap, or on the all-to-all
dispatcher, nothing changes; Megatron's three spellings of the setting reach one field. And HybridEP inside a node
runs at its measured bandwidth where the hardware file gives it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from primuspipe.projection.comm import hybridep_timed, layer_comm
from primuspipe.projection.compute import WorkModel
from primuspipe.projection.hardware_spec import check_runs_on, load_hardware
from primuspipe.projection.megatron_args import read_arguments
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import RankShape, TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
H100 = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
MODEL = load_model(EXAMPLES / "models" / "qwen3-30b-a3b.yaml")
OVERLAPPED = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=16, data_parallel_size=16,
                          global_batch_size=16, moe_token_dispatcher_type="flex",
                          overlap_moe_expert_parallel_comm=True)


@pytest.mark.parametrize(("fields", "sms"), [({}, 20), ({"moe_flex_dispatcher_backend": "hybridep"}, 24),
                                             ({"moe_flex_dispatcher_num_sms": 32}, 32)])
def test_the_overlapped_compute_runs_on_the_sms_the_dispatcher_leaves(fields, sms):
    training = dataclasses.replace(OVERLAPPED, **fields)
    comm = layer_comm(MODEL, training, H100, "moe")
    share = sms / H100.compute_units
    assert comm.dispatcher_share == pytest.approx(share)
    ep = comm.ep[0]
    for compute in (0.5 * ep, ep, 3 * ep):  # the all-to-all outlasting the compute, matching it, hidden under it
        beside = min(ep, compute)
        exposed = comm.exposed(training, (0.0,) * 3, (0.0,) * 3, (compute,) * 3)
        assert exposed[0] - comm.tp[0] - comm.cp[0] - comm.blocking[0] == pytest.approx(
            ep - beside + beside * share / (1 - share))
    plain = dataclasses.replace(training, overlap_moe_expert_parallel_comm=False)
    assert layer_comm(MODEL, plain, H100, "moe").dispatcher_share == 0.0  # nothing runs beside it
    a2a = dataclasses.replace(training, moe_token_dispatcher_type="alltoall")
    assert layer_comm(MODEL, a2a, H100, "moe").dispatcher_share == 0.0  # NCCL's kernels: not modelled
    assert layer_comm(MODEL, training, H100, "dense").dispatcher_share == 0.0


def test_megatrons_spellings_set_the_dispatchers_sms():
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1000 --num-experts 16 --moe-router-topk 4 --micro-batch-size 1 --global-batch-size 8 "
            "--bf16 --moe-token-dispatcher-type flex ")
    for flag in ("--moe-flex-dispatcher-num-sms", "--moe-deepep-num-sms", "--moe-hybridep-num-sms"):
        config = read_arguments(base + f"{flag} 28", "run")
        assert config.training.moe_flex_dispatcher_num_sms == 28, flag
        assert flag[2:].replace("-", "_") not in config.no_effect


def test_a_dispatcher_that_takes_every_sm_or_none_is_refused():
    with pytest.raises(InputError, match="moe_flex_dispatcher_num_sms"):
        dataclasses.replace(OVERLAPPED, moe_flex_dispatcher_num_sms=0)
    with pytest.raises(InputError, match="compute_units"):
        check_runs_on(dataclasses.replace(OVERLAPPED, moe_flex_dispatcher_num_sms=H100.compute_units), H100)


def test_hybridep_inside_a_node_runs_at_its_measured_bandwidth():
    """The B200 file's HybridEP figure (DeepEP hybrid-ep's Torch-API benchmark) times the flex all-to-alls on
    HybridEP inside a node: the received rows (own rank's included) over the measured bandwidth; DeepEP, the
    all-to-all dispatcher and a hardware file without the figure keep the fabric's model."""
    b200 = load_hardware(EXAMPLES / "hardware" / "b200.yaml")
    assert b200.hybridep_bandwidth_bytes_per_s == pytest.approx(530.86e9)
    inside = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=8, data_parallel_size=8,
                          global_batch_size=8, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
    deepep = dataclasses.replace(inside, moe_flex_dispatcher_backend="deepep")
    fabric_only = dataclasses.replace(b200, deepep_sm_bandwidth_bytes_per_s=None)  # DeepEP bound by the fabric alone
    timed, fabric = layer_comm(MODEL, inside, b200, "moe").ep[0], layer_comm(MODEL, deepep, fabric_only, "moe").ep[0]
    latency = 2 * 7 * b200.intra_node_latency_s
    # same rows either way: the fabric's all-to-all moves (n-1)/n of them at 900 GB/s x network_efficiency; the
    # measured call's rate holds its own latency (the file fits none beside it)
    rows = (fabric - latency) / 2 * b200.intra_node_bandwidth_bytes_per_s * b200.network_efficiency * 8 / 7
    assert b200.hybridep_rank_latency_s is None
    assert timed == pytest.approx(2 * rows / b200.hybridep_bandwidth_bytes_per_s)
    assert timed > fabric
    bare = dataclasses.replace(fabric_only, hybridep_bandwidth_bytes_per_s=None)
    assert layer_comm(MODEL, inside, bare, "moe").ep[0] == pytest.approx(fabric + _permuting_copy(inside, bare))
    across = dataclasses.replace(inside, expert_model_parallel_size=16, data_parallel_size=16, global_batch_size=16)
    assert layer_comm(MODEL, across, b200, "moe").ep[0] == layer_comm(MODEL, across, bare, "moe").ep[0]


def _permuting_copy(training: TrainingSpec, hardware) -> float:
    """Seconds of a read and a write of every routed copy, each way (dispatch and combine), at the file's rate."""
    shape = RankShape(MODEL, training)
    copies = shape.residual_tokens * MODEL.moe_router_topk * shape.load_imbalance
    return 2 * 2 * copies * MODEL.hidden_size * shape.e / (hardware.hbm_bandwidth_bytes_per_s
                                                             * hardware.memory_bandwidth_fraction)


@pytest.mark.parametrize("hardware", ["b200", "h100"])
def test_hybridep_permutes_inside_its_dispatch_and_combine(hardware):
    """megatron-core's HybridEP manager passes the dispatched rows through (dispatch_with_permute /
    combine_with_unpermute permute them): no permutation in the layer's element-wise work, where DeepEP has one.
    Inside a B200 node the measured call holds that copy; on the fabric's rates (an H100 node, or across nodes)
    the all-to-all adds it, so there a layer costs what it did with the permutation priced apart."""
    spec = load_hardware(EXAMPLES / "hardware" / f"{hardware}.yaml")
    hybridep = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=8, data_parallel_size=8,
                            global_batch_size=8, moe_token_dispatcher_type="flex",
                            moe_flex_dispatcher_backend="hybridep", moe_permute_fusion=True)
    deepep = dataclasses.replace(hybridep, moe_flex_dispatcher_backend="deepep")
    assert WorkModel(MODEL, hybridep).permutations == 0 and WorkModel(MODEL, deepep).permutations == 1
    element = {t.moe_flex_dispatcher_backend: WorkModel(MODEL, t)._elementwise("moe").forward.memory_bytes
               for t in (hybridep, deepep)}
    shape = RankShape(MODEL, hybridep)
    copies = shape.residual_tokens * MODEL.moe_router_topk * shape.load_imbalance
    assert element["deepep"] - element["hybridep"] == pytest.approx(4 * copies * MODEL.hidden_size * shape.e)
    timed = hybridep_timed(hybridep, spec, 1)
    assert timed == (hardware == "b200")
    if timed:  # the measured rate holds the copy: nothing added
        call = copies * 5.3 / 8 * MODEL.hidden_size * shape.e / spec.hybridep_bandwidth_bytes_per_s  # 5.3 ranks of 8
        assert layer_comm(MODEL, hybridep, spec, "moe").ep[0] == pytest.approx(2 * call, rel=0.02)
    # on the fabric's rates alike (no measured HybridEP call, DeepEP not bound by its SMs) HybridEP adds the copy
    fabric_only = dataclasses.replace(spec, hybridep_bandwidth_bytes_per_s=None, deepep_sm_bandwidth_bytes_per_s=None)
    fabric = (layer_comm(MODEL, hybridep, fabric_only, "moe").ep[0]
              - layer_comm(MODEL, deepep, fabric_only, "moe").ep[0])
    assert fabric == pytest.approx(_permuting_copy(hybridep, spec))
