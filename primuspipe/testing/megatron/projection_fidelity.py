"""Projected vs measured: a real CPU pipeline run of a tiny megatron-core GPT, and the projection of it.

What ``bench/bench_projection.py`` reports and the projection tests check loosely: the tiny GPT of
:mod:`primuspipe.testing.megatron.tiny_models` trains with megatron-core's own 1F1B on ``pp`` gloo
ranks (one thread each) and its forward-backward step is timed; the projection predicts the same step
from the layer benchmark (the model's real layers timed on this host, scaled for ``pp`` ranks sharing its
cores), a gloo ping-pong for the point-to-point link, and the simulator.
"""

from __future__ import annotations

import statistics
import time

from primuspipe.projection.benchmark.layers import benchmark_calibration
from primuspipe.projection.comm import p2p_message_bytes
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.projection import Projector
from primuspipe.projection.training_spec import TrainingSpec


def specs(tiny, pp: int, microbatches: int) -> tuple[ModelSpec, TrainingSpec]:
    """The projection's model and training specs of the tiny GPT run (``tiny`` a ``TinyModelConfig``, as
    ``tiny_models`` builds it: GELU MLP with biases, LayerNorm, learned positions, untied, fp32)."""
    model = ModelSpec(name="tiny-gpt", num_layers=tiny.num_layers, hidden_size=tiny.hidden_size,
                      ffn_hidden_size=tiny.ffn_hidden_size, num_attention_heads=tiny.num_attention_heads,
                      seq_length=tiny.seq_length, padded_vocab_size=tiny.vocab_size, swiglu=False,
                      normalization="LayerNorm", add_bias_linear=tiny.add_bias_linear,
                      position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=True)
    training = TrainingSpec(micro_batch_size=tiny.micro_batch_size, global_batch_size=tiny.micro_batch_size * microbatches,
                            pipeline_model_parallel_size=pp, precision="fp32", attention_backend="local",
                            bias_activation_fusion=False, use_distributed_optimizer=False, overlap_grad_reduce=False)
    return model, training


def measured_steps(tiny, pp: int, microbatches: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each timed step of Megatron's 1F1B (the slowest rank's)."""
    from primuspipe.testing.megatron import compare
    from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo

    spec = compare.StepSpec(tiny, microbatches)

    def work(ctx):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        _, chunks, _ = compare.build(spec, pp, 1)
        times = []
        for _ in range(warmup + steps):
            for c in chunks:
                c.zero_grad(set_to_none=True)
            times.append(compare.call_schedule(get_forward_backward_func(), spec, chunks)[1])
        return times[warmup:]

    per_rank = run_on_gloo(work, ParallelLayout(pp), timeout_s=3600)
    return [max(r[i] for r in per_rank) for i in range(steps)]


def gloo_link(message_bytes: float, rounds: int = 50) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a gloo send between two CPU processes, from ping-pong times of a
    one-element and a ``message_bytes`` tensor."""
    from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo

    def work(ctx):
        import torch
        import torch.distributed as dist

        def one_way(numel: int) -> float:
            buffer = torch.zeros(numel)
            samples = []
            for _ in range(rounds):
                start = time.perf_counter()
                if ctx.rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                samples.append((time.perf_counter() - start) / 2)
            return statistics.median(samples)

        return one_way(1), one_way(max(1, int(message_bytes // 4)))

    small, large = run_on_gloo(work, ParallelLayout(2))[0]
    return small, message_bytes / max(large - small, 1e-9)


def projected_step(tiny, pp: int, microbatches: int, iterations: int) -> dict:
    """The projection of the run :func:`measured_steps` times: its pipeline step (the simulated 1F1B,
    without the optimizer step the timed call does not include) and what it was built from."""
    model, training = specs(tiny, pp, microbatches)
    latency, bandwidth = gloo_link(p2p_message_bytes(model, training))
    host = HardwareSpec(name="this CPU (gloo)", peak_bf16_tflops=1.0, hbm_bytes=24e9, hbm_bandwidth_bytes_per_s=20e9,
                        intra_node_bandwidth_bytes_per_s=bandwidth, inter_node_bandwidth_bytes_per_s=bandwidth,
                        intra_node_latency_s=latency, inter_node_latency_s=latency, network_efficiency=1.0,
                        gpus_per_node=64)
    calibration = benchmark_calibration(model, training, host, iterations=iterations, warmup=3, host_ranks=pp)
    result = Projector(model, host, calibration).evaluate(training, "1f1b")
    return {"projected_step_s": result.pipeline_time_s, "bubble_rate": result.bubble_rate,
            "p2p_latency_s": latency, "p2p_bandwidth_bytes_per_s": bandwidth}


