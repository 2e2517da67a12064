"""The layer benchmark (real megatron-core layers timed on this host) and the prediction path it feeds,
end to end against a real multi-process CPU run. Timing is only sanity-bounded here; the 10 % fidelity
figure is bench/bench_projection.py's."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch

from primuspipe.testing.megatron.tiny_models import TinyModelConfig
from primuspipe.testing.megatron.projection_fidelity import measured_steps, projected_step, specs
from primuspipe.projection.benchmark.layers import benchmark_shape, calibration_from_timings, measure
from primuspipe.projection.compute import PASSES, WorkModel, part_times
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.training_spec import TrainingSpec

TINY = TinyModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256,
                       seq_length=32, micro_batch_size=2)
HOST = HardwareSpec(name="cpu", peak_bf16_tflops=1.0, hbm_bytes=16e9, hbm_bandwidth_bytes_per_s=2e10,
                    intra_node_bandwidth_bytes_per_s=1e9, inter_node_bandwidth_bytes_per_s=1e9)


def test_benchmark_shape_is_one_rank_of_the_target():
    model = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
                      seq_length=64, vocab_size=1000, num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=128,
                      moe_shared_expert_intermediate_size=256)
    training = TrainingSpec(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                            expert_model_parallel_size=4, expert_tensor_parallel_size=1, data_parallel_size=4,
                            global_batch_size=64)
    one, single = benchmark_shape(model, training)
    assert (one.num_attention_heads, one.query_groups, one.head_dim, one.ffn, one.seq_length) == (4, 2, 32, 256, 32)
    assert (one.num_experts, one.moe_router_topk, one.expert_ffn, one.moe_shared_expert_intermediate_size) == (2, 2, 128, 128)
    assert one.padded_vocab(1) == model.padded_vocab(2) // 2
    assert single.world_size == 1 and single.attention_backend == "local"


def test_layer_benchmark_times_every_pass_and_calibrates_to_what_it_measured():
    model, training = specs(TINY, 2, 4)
    measured = measure(model, training, iterations=3, warmup=1)
    assert {part for part, _ in measured} == {"dense", "embedding", "head"}
    for part in ("dense", "head"):
        assert all(measured[(part, name)] > 0 for name in PASSES)
    calibration = calibration_from_timings(model, training, HOST, measured, source="test")
    # at the benchmark's own shape, calibrated times are the measured ones
    calibrated = part_times(WorkModel(*benchmark_shape(model, training)), HOST, calibration)
    for part in ("dense", "head"):
        assert [getattr(calibrated[part], name) for name in PASSES] == pytest.approx([measured[(part, n)] for n in PASSES])


@pytest.mark.slow
def test_projected_step_of_a_real_cpu_run_is_in_its_range():
    """pp = 2 tiny GPT with megatron-core's 1F1B on two gloo ranks, against the projection built from the
    layer benchmark of the same model: a loose bound (machines differ, steps are milliseconds)."""
    tiny = dataclasses.replace(TINY, hidden_size=128, ffn_hidden_size=512, seq_length=64)
    projected = projected_step(tiny, 2, 4, iterations=5)["projected_step_s"]
    measured = statistics.median(measured_steps(tiny, 2, 4, steps=3, warmup=1))
    assert 0.33 < projected / measured < 3.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_pass_is_timed_by_its_kernels_not_the_hosts_time_issuing_them():
    """A host that takes 20 ms between two tiny kernels: the layer benchmark's device timer reports the kernels'
    microseconds once its lead has settled (a wall clock reported the launches: 7-60x the model's time for a
    small part on a lent H100), and a large product's time whatever the host."""
    from primuspipe.projection.benchmark.layers import _DeviceSeconds

    x = torch.zeros(16, device="cuda")

    def slow_host() -> None:
        x.add_(1.0)
        time.sleep(0.02)
        x.add_(1.0)

    timer = _DeviceSeconds()
    first = timer(slow_host)  # the 5 ms lead is too short: the span holds the host's wait, and the lead grows
    assert first > 0.01 and timer.lead_s >= 0.04
    assert timer(slow_host) < 0.005
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    product = timer(lambda: a @ a)
    assert 1e-4 < product < 0.1 and 2 * 8192**3 / product < 1.2e15  # no faster than a GPU can be
