"""Projection fidelity: projected vs measured step time of a real CPU run, and the projection's speed.

    PYTHONPATH=. python bench/bench_projection.py [--pp 2 4] [--microbatches 32] [--rounds 3] [--out bench/results/projection.json]

For each pp: a tiny megatron-core GPT trains with Megatron's own 1F1B schedule on pp CPU ranks (gloo,
one thread each) and its forward-backward step is timed (median over steps after a warm-up, the
slowest rank per step). Independently, the projection predicts that step (rounds of projection and
measurement alternate; the error is the median of the rounds' errors, each round's two figures taken
under the same host speed): the layer benchmark times
the model's real layers (F, dgrad, wgrad), embedding and head on this host, scaled by pp / cores where
the pipeline's ranks outnumber this host's cores (they time-share them); a gloo ping-pong
measures the point-to-point link; the projection simulates 1F1B with those costs. The check: the
projected pipeline time within 10 % of the measured step. Timings mean something only on a host nobody
else is using: each round records the CPU load other processes put on the host meanwhile
(``other_processes_cpu_load``, in cores), and a run where it passed 0.2 is marked ``host_shared``.

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

from primuspipe.testing.megatron.projection_fidelity import measured_steps, projected_step

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_PAIRS = (("llama2-7b", "mi300x", None), ("mixtral-8x7b", "h100", "mixtral-8x7b"))


def tiny_gpt(args):
    from primuspipe.testing.megatron import tiny_models

    return tiny_models.TinyModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                                       ffn_hidden_size=4 * args.hidden, vocab_size=1024, seq_length=args.seq,
                                       micro_batch_size=args.micro_batch_size)


def busy_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process on the host has used, CPU seconds this bench and its finished children
    have used) so far: their growth over a round tells whether others shared the host meanwhile."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    mine = os.times()
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), mine.user + mine.system + mine.children_user + mine.children_system


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
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps of the real run per round")
    p.add_argument("--rounds", type=int, default=3, help="projection + measurement rounds per pp (medians are reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iterations", type=int, default=15, help="timed repetitions per pass in the layer benchmark")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "projection.json"))
    args = p.parse_args()
    tiny = tiny_gpt(args)
    runs = []
    for pp in args.pp:
        # projection and measurement alternate, so a host whose speed drifts (a shared VM) affects both
        rounds = []
        for _ in range(args.rounds):
            host_before, mine_before, start = *busy_cpu_seconds(), time.perf_counter()
            projected = projected_step(tiny, pp, args.microbatches, args.iterations)
            steps = measured_steps(tiny, pp, args.microbatches, args.steps, args.warmup)
            host_after, mine_after = busy_cpu_seconds()
            others = max(0.0, (host_after - host_before) - (mine_after - mine_before)) / (time.perf_counter() - start)
            rounds.append({**projected, "measured_step_s": statistics.median(steps), "measured_steps_s": steps,
                           "other_processes_cpu_load": others})
        projected_s = statistics.median(r["projected_step_s"] for r in rounds)
        measured_s = statistics.median(r["measured_step_s"] for r in rounds)
        error = statistics.median(r["projected_step_s"] / r["measured_step_s"] for r in rounds) - 1  # per round: same host speed
        busiest = max(r["other_processes_cpu_load"] for r in rounds)
        runs.append({"pp": pp, "algorithm": "1f1b (megatron-core's own schedule)", "microbatches": args.microbatches,
                     "projected_step_s": projected_s, "measured_step_s": measured_s, "error": error,
                     "within_10_percent": abs(error) <= 0.10, "host_shared": busiest > 0.2, "rounds": rounds})
        print(json.dumps({k: runs[-1][k] for k in ("pp", "projected_step_s", "measured_step_s", "error", "host_shared")}),
              flush=True)
    result = {"bench": "projection", "model": dataclasses.asdict(tiny),
              "threads_per_rank": 1, "runs": runs, "project_wall_time": project_wall_times(),
              "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["project_wall_time"]))


if __name__ == "__main__":
    main()
