"""Overlapped data-parallel collectives hold compute units (issue 26): across nodes NCCL runs a ring collective on
``collective_ctas_per_card`` CTAs per network card the group uses on a node, none shared with compute, so the compute
beside a collective's hidden part takes ``1 / (1 - CTAs / SMs)`` as long."""

import dataclasses
from pathlib import Path

import pytest

from primuspipe.projection.comm import Collectives, gradient_sync
from primuspipe.projection.hardware_spec import HardwareSpec, load_hardware
from primuspipe.projection.parameters import ParamCount
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec

H100 = load_hardware(Path(__file__).resolve().parents[2] / "examples" / "projection" / "hardware" / "h100.yaml")
BARE = dataclasses.replace(H100, collective_ctas_per_card=None)
PARAMS = ParamCount(dense=2_000_000_000)
BACKWARD_S = 0.3  # one microbatch's backward: hides all but what outlasts it


def _training(tp: int, dp: int, **overrides) -> TrainingSpec:
    fields = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, data_parallel_size=dp,
                  global_batch_size=8 * dp, use_distributed_optimizer=False, overlap_grad_reduce=True)
    return TrainingSpec(**{**fields, **overrides})


@pytest.mark.parametrize("tp, members", [(8, 1), (4, 2), (1, 8)])
def test_the_hidden_reduction_slows_the_compute_beside_it_by_the_cards_ctas(tp, members):
    """DP 16 across nodes with ``members`` ranks of the group on each node: 2 CTAs a card, ``2 members`` of 132 SMs."""
    training = _training(tp, 16)
    whole = Collectives(H100).all_reduce(PARAMS.dense * training.main_grad_bytes, 16, tp * 16)
    exposed = gradient_sync(PARAMS, training, BARE, buckets=1_000, backward_s=BACKWARD_S)
    assert 0 < exposed < whole  # partly hidden under the backward
    share = 2 * members / 132
    assert gradient_sync(PARAMS, training, H100, buckets=1_000, backward_s=BACKWARD_S) == pytest.approx(
        exposed + (whole - exposed) * share / (1 - share))


def test_collectives_that_hide_nothing_or_stay_inside_an_nvlink_node_cost_no_compute():
    """The H100 file gives no intra-node channel count (no source gives NCCL's on NVLink)."""
    for training in (_training(8, 16, overlap_grad_reduce=False), _training(1, 8), _training(2, 4)):
        assert gradient_sync(PARAMS, training, H100, buckets=1_000, backward_s=BACKWARD_S) == pytest.approx(
            gradient_sync(PARAMS, training, BARE, buckets=1_000, backward_s=BACKWARD_S))


def test_sharded_gradients_pay_for_every_microbatchs_hidden_reduction():
    """Megatron-FSDP reduce-scatters every microbatch's gradients beside the later compute, and the step's weight
    gather runs under the first forward: each hides all but its last bucket here, and all of it slows the compute."""
    training = _training(8, 16, use_distributed_optimizer=True, use_megatron_fsdp=True, overlap_param_gather=True,
                         data_parallel_sharding_strategy="optim_grads")
    net = Collectives(H100)
    reduce, gather = (net.gather(PARAMS.dense * size, 16, 128) for size in (training.main_grad_bytes, 2))
    exposed = gradient_sync(PARAMS, training, BARE, buckets=1_000, forward_s=1.0, backward_s=2.0)
    assert exposed == pytest.approx((reduce + gather) / 1_000)
    share = 2 / 132
    assert gradient_sync(PARAMS, training, H100, buckets=1_000, forward_s=1.0, backward_s=2.0) == pytest.approx(
        exposed + (training.microbatches * reduce + gather - exposed) * share / (1 - share))


def test_a_node_of_collectives_holding_every_unit_is_refused():
    with pytest.raises(InputError, match="collective_ctas_per_card"):
        HardwareSpec(name="x", peak_bf16_tflops=100.0, achievable_fraction=0.5, hbm_bytes=80e9,
                     hbm_bandwidth_bytes_per_s=2e12, intra_node_bandwidth_bytes_per_s=100e9,
                     inter_node_bandwidth_bytes_per_s=10e9, intra_node_latency_s=1e-5, inter_node_latency_s=2e-5,
                     network_efficiency=1.0, gpus_per_node=8, compute_units=16, collective_ctas_per_card=2)


MI355X = load_hardware(Path(__file__).resolve().parents[2] / "examples" / "projection" / "hardware" / "mi355x.yaml")
MESH_BARE = dataclasses.replace(MI355X, intra_node_collective_channels=None)


@pytest.mark.parametrize("dp, channels", [(8, 112), (2, 32), (4, 48)])
def test_inside_a_node_rccls_channels_slow_the_compute_beside_the_hidden_reduction(dp, channels):
    """RCCL runs a ring collective among ``dp`` GPUs of one MI355X node on its channels for that group size (112 for
    8, 48 for 4, 32 for 2), each a workgroup on a compute unit of its own: the compute beside the hidden part of the
    gradient reduction takes ``1 / (1 - channels / 256)`` as long."""
    training = _training(8 // dp, dp)
    whole = Collectives(MI355X).all_reduce(PARAMS.dense * training.main_grad_bytes, dp, 8)
    exposed = gradient_sync(PARAMS, training, MESH_BARE, buckets=1_000, backward_s=BACKWARD_S)
    assert 0 < exposed < whole
    share = channels / 256
    assert gradient_sync(PARAMS, training, MI355X, buckets=1_000, backward_s=BACKWARD_S) == pytest.approx(
        exposed + (whole - exposed) * share / (1 - share))


def test_a_group_between_listed_sizes_takes_the_largest_size_below_it():
    assert Collectives(MI355X).compute_share(6, 8) == pytest.approx(48 / 256)
    assert Collectives(MI355X).compute_share(3, 6) == pytest.approx(32 / 256)


@pytest.mark.parametrize("pairs", [[[1, 8]], [[16, 8]], [[8, 256]], [[8, 0]], [[8]], [[8, 112, 4]],
                                   [[8, 112], [8, 56]]])
def test_a_channel_table_outside_the_node_or_the_units_or_naming_a_size_twice_is_refused(pairs):
    with pytest.raises(InputError, match="intra_node_collective_channels"):
        dataclasses.replace(MI355X, intra_node_collective_channels=tuple(tuple(p) for p in pairs))
