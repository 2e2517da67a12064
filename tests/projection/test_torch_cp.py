"""PyTorch's experimental context parallelism (``cp_implementation: torch-allgather | torch-alltoall``): the bytes
each collective moves and what the attention steps hide, for Llama 3 8B at 8,192 tokens, CP 4, on one node."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from primuspipe.projection.comm import layer_comm
from primuspipe.projection.compute import WorkModel
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
HW = HardwareSpec(name="t", peak_bf16_tflops=100.0, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=1e12,
                  memory_bandwidth_fraction=1.0, intra_node_bandwidth_bytes_per_s=100e9,
                  inter_node_bandwidth_bytes_per_s=10e9, network_efficiency=1.0, gpus_per_node=8,
                  intra_node_latency_s=0.0)
MODEL = load_model(EXAMPLES / "models" / "llama3-8b.yaml")  # 8,192 tokens, 8 KV heads of 128
# the whole sequence's K and V in bf16: 8,192 x 2 x 8 x 128 x 2 bytes = 32 MiB; a rank's block a quarter of it
KV = 8192 * 2 * 8 * 128 * 2
GATHER = 0.75 * KV / 100e9      # ring all-gather of the 32 MiB over 4 ranks at 100 GB/s
KV_SHIFT = KV / 4 / 100e9       # one rank's bf16 K, V block to the next rank
DKV_SHIFT = KV / 4 * 2 / 100e9  # one rank's fp32 dK, dV block to the next rank
ATTENTION = (4e-4, 8e-4, 0.0)   # F and B attention of the layer: 1e-4 and 2e-4 s per step of 4


def training(impl: str, cp: int = 4, compiled: bool = False) -> TrainingSpec:
    return TrainingSpec(context_parallel_size=cp, pipeline_model_parallel_size=1, global_batch_size=1,
                        data_parallel_size=1, micro_batch_size=1, cp_implementation=impl, cp_compiled=compiled)


def test_allgather_hides_the_kv_gather_under_step_zero_only():
    t = training("torch-allgather")
    comm = layer_comm(MODEL, t, HW, "dense")
    assert GATHER == pytest.approx(2.5165824e-4) and DKV_SHIFT == pytest.approx(1.6777216e-4)
    assert comm.cp == pytest.approx((GATHER, GATHER + 4 * DKV_SHIFT, 0.0))
    f, b, w = comm.exposed(t, (0.0,) * 3, ATTENTION, (1.0,) * 3)
    # F: the gather outlasts step 0 by 1.5166e-4; B: again by 0.5166e-4, the dK/dV passes hide under steps 1-3,
    # the last pass (after the loop) shows whole
    assert (f, b, w) == pytest.approx((1.5165824e-4, 0.5165824e-4 + 1.6777216e-4, 0.0))


def test_alltoall_passes_each_block_under_one_step():
    t = training("torch-alltoall")
    comm = layer_comm(MODEL, t, HW, "dense")
    assert comm.cp == pytest.approx((3 * KV_SHIFT, 3 * KV_SHIFT + 4 * DKV_SHIFT, 0.0))
    f, b, _ = comm.exposed(t, (0.0,) * 3, ATTENTION, (1.0,) * 3)
    # F: 8.39e-5 under 1e-4 each: hidden; B: steps 1 and 2 carry a KV block and a dK/dV block (2.5166e-4 under
    # 2e-4), step 3 a dK/dV block (hidden), the last dK/dV block shows
    assert (f, b) == pytest.approx((0.0, 2 * 0.5165824e-4 + 1.6777216e-4))


@pytest.mark.parametrize("impl", ["torch-allgather", "torch-alltoall"])
def test_a_compiled_ring_waits_for_every_transfer(impl):
    """Traced by torch.compile each functional collective is waited where it is issued: the same bytes, none
    hidden under an attention step."""
    eager, compiled = training(impl), training(impl, compiled=True)
    comm = layer_comm(MODEL, compiled, HW, "dense")
    assert comm.cp == pytest.approx(layer_comm(MODEL, eager, HW, "dense").cp)
    f, b, w = comm.exposed(compiled, (0.0,) * 3, ATTENTION, (1.0,) * 3)
    assert (f, b, w) == pytest.approx(comm.cp)
    assert (f, b) > layer_comm(MODEL, eager, HW, "dense").exposed(eager, (0.0,) * 3, ATTENTION, (1.0,) * 3)[:2]


def test_te_p2p_stays_as_it_was():
    t = training("te-p2p")
    comm = layer_comm(MODEL, t, HW, "dense")
    assert comm.cp_steps == () and comm.cp == pytest.approx((GATHER, 2 * GATHER, 0.0))
    assert comm.exposed(t, (0.0,) * 3, ATTENTION, (1.0,) * 3)[0] == pytest.approx(max(GATHER / 4, GATHER - 4e-4))


def test_a_torch_cp_implementation_needs_cp():
    with pytest.raises(InputError, match="cp_implementation"):
        training("torch-allgather", cp=1)


def test_only_pytorchs_ring_is_compiled():
    with pytest.raises(InputError, match="cp_compiled"):
        training("te-p2p", compiled=True)


def test_torchtitan_exchanges_the_repeated_kv_heads():
    """torchtitan's Llama repeats the 8 KV heads to the 32 query heads before SDPA (repeat_kv): the ring moves 4x."""
    t = training("torch-allgather")
    titan = TrainingSpec(context_parallel_size=4, pipeline_model_parallel_size=1, global_batch_size=1,
                         data_parallel_size=1, micro_batch_size=1, cp_implementation="torch-allgather",
                         model_implementation="torchtitan")
    assert layer_comm(MODEL, titan, HW, "dense").cp == pytest.approx(
        tuple(4 * c for c in layer_comm(MODEL, t, HW, "dense").cp))
    assert layer_comm(MODEL, titan, HW, "dense").cp[0] == pytest.approx(4 * 2.5165824e-4)


def test_torchtitan_ring_accumulates_the_repeated_kv_gradients():
    """PyTorch's ring keeps dK / dV in fp32 at the shape of the K, V SDPA is given: torchtitan's 32 repeated heads,
    not the 8 groups. Per step it reads the step's bf16 gradient and reads and writes the fp32 sum (2 + 8 bytes)."""
    plain = WorkModel(MODEL, training("torch-allgather"))._attention_core()
    titan = WorkModel(MODEL, replace(training("torch-allgather"), model_implementation="torchtitan"))._attention_core()
    assert titan.forward.memory_bytes == plain.forward.memory_bytes
    extra = titan.backward_input.memory_bytes - plain.backward_input.memory_bytes
    assert extra == pytest.approx(4 * 8192 / 4 * (32 - 8) * (128 + 128) * (2 + 8))
