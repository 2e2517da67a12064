"""Projection fidelity: projected vs measured step time of a real CPU run, and the projection's speed.

    python bench/bench_projection.py [--pp 2 4] [--microbatches 8] [--steps 6] [--out bench/results/projection.json]

For each pp: a tiny megatron-core GPT trains with Megatron's own 1F1B schedule on pp CPU ranks (gloo,
one thread each) and its forward-backward step is timed (median over steps after a warm-up, the
slowest rank per step). Independently, the projection predicts that step: the layer benchmark times
the model's real layers (F, dgrad, wgrad), embedding and head on this host, run as pp concurrent
processes like the pipeline's ranks (this host may have fewer cores than ranks); a gloo ping-pong
measures the point-to-point link; the projection simulates 1F1B with those costs. The check: the
projected pipeline time within 10 % of the measured step.

Also timed: ``primuspipe project`` on two shipped model/hardware pairs (the whole command, imports
included), which should answer in under 10 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_PAIRS = (("llama2-7b", "mi300x", None), ("mixtral-8x7b", "h100", "mixtral-8x7b"))


def tiny_gpt(args):
    from primuspipe.backends.megatron import tiny_models

    return tiny_models.TinyModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                                       ffn_hidden_size=4 * args.hidden, vocab_size=1024, seq_length=args.seq,
                                       micro_batch_size=args.micro_batch_size)


def specs(tiny, pp: int, microbatches: int):
    """The projection's model and training specs of the tiny GPT run (what tiny_models builds)."""
    from primuspipe.projection.model_spec import ModelSpec
    from primuspipe.projection.training_spec import TrainingSpec

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
    from primuspipe.backends.megatron import compare
    from primuspipe.backends.megatron.distributed_cpu import ParallelLayout, run_on_gloo

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
    from primuspipe.backends.megatron.distributed_cpu import ParallelLayout, run_on_gloo

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
    from primuspipe.projection.benchmark.layers import benchmark_calibration
    from primuspipe.projection.comm import p2p_message_bytes
    from primuspipe.projection.hardware_spec import HardwareSpec
    from primuspipe.projection.projection import Projector

    model, training = specs(tiny, pp, microbatches)
    latency, bandwidth = gloo_link(p2p_message_bytes(model, training))
    host = HardwareSpec(name="this CPU (gloo)", peak_bf16_tflops=1.0, hbm_bytes=24e9, hbm_bandwidth_bytes_per_s=20e9,
                        intra_node_bandwidth_bytes_per_s=bandwidth, inter_node_bandwidth_bytes_per_s=bandwidth,
                        intra_node_latency_s=latency, inter_node_latency_s=latency, network_efficiency=1.0,
                        gpus_per_node=64)
    calibration = benchmark_calibration(model, training, host, iterations=iterations, warmup=3, concurrent_ranks=pp)
    result = Projector(model, host, calibration).evaluate(training, "1f1b")
    return {"projected_step_s": result.pipeline_time_s, "bubble_rate": result.bubble_rate,
            "p2p_latency_s": latency, "p2p_bandwidth_bytes_per_s": bandwidth}


def project_wall_times() -> list[dict]:
    out = []
    for model, hardware, training in SHIPPED_PAIRS:
        command = [sys.executable, "-c", "import sys; from primuspipe.cli import main; sys.exit(main())", "project", "--model",
                   f"examples/projection/models/{model}.yaml", "--hardware", f"examples/projection/hardware/{hardware}.yaml",
                   "--json"] + (["--training", f"examples/projection/training/{training}.yaml"] if training else [])
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out.append({"model": model, "hardware": hardware, "seconds": time.perf_counter() - start})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps of the real run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iterations", type=int, default=15, help="timed repetitions per pass in the layer benchmark")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "projection.json"))
    args = p.parse_args()
    tiny = tiny_gpt(args)
    runs = []
    for pp in args.pp:
        projected = projected_step(tiny, pp, args.microbatches, args.iterations)
        steps = measured_steps(tiny, pp, args.microbatches, args.steps, args.warmup)
        measured = statistics.median(steps)
        runs.append({"pp": pp, "algorithm": "1f1b (megatron-core's own schedule)", "microbatches": args.microbatches,
                     **projected, "measured_step_s": measured, "measured_steps_s": steps,
                     "error": projected["projected_step_s"] / measured - 1,
                     "within_10_percent": abs(projected["projected_step_s"] / measured - 1) <= 0.10})
        print(json.dumps({k: runs[-1][k] for k in ("pp", "projected_step_s", "measured_step_s", "error")}), flush=True)
    result = {"bench": "projection", "model": dataclasses.asdict(tiny),
              "threads_per_rank": 1, "runs": runs, "project_wall_time": project_wall_times(),
              "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["project_wall_time"]))


if __name__ == "__main__":
    main()
