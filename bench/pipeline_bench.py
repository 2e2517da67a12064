"""What the pipeline benches share: the tiny-GPT size flags and the alternating timing loop.

Both benches time several forward-backward functions on the same two CPU ranks, model chunks and
data, alternating their order every step after a warm-up so drift (a busy host, caches) hits each
equally. A step ends when its slowest rank ends, so each step's time is the max over ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser, *, steps: int, hidden: int, seq: int, layers: int, out: str) -> None:
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / out), help="JSON result file")


def tiny_gpt(args: argparse.Namespace):
    from primuspipe.testing.megatron import tiny_models

    return dataclasses.replace(tiny_models.TINY_MODELS["tiny-gpt"], hidden_size=args.hidden,
                               ffn_hidden_size=4 * args.hidden, num_attention_heads=4, seq_length=args.seq,
                               micro_batch_size=args.micro_batch_size, num_layers=args.layers, vocab_size=512)


def alternating_step_times(make_schedules: Callable[[], dict[str, Callable]], args: argparse.Namespace,
                           timeout_s: float = 3600) -> dict[str, list[float]]:
    """Seconds per timed step of each schedule on two gloo ranks (pp=2, one thread each).

    ``make_schedules`` runs inside each rank and returns ``{name: forward_backward_func}``.
    """
    from primuspipe.testing.megatron import compare
    from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo

    spec = compare.StepSpec(tiny_gpt(args), args.microbatches)

    def work(ctx):
        _, chunks, _ = compare.build(spec, 2, 1)
        schedules = make_schedules()
        names = list(schedules)
        times = {name: [] for name in names}
        for step in range(args.warmup + args.steps):
            for name in (names if step % 2 == 0 else names[::-1]):
                for c in chunks:
                    c.zero_grad(set_to_none=True)
                _, seconds = compare.call_schedule(schedules[name], spec, chunks)
                if step >= args.warmup:
                    times[name].append(seconds)
        return times

    per_rank = run_on_gloo(work, ParallelLayout(2), timeout_s=timeout_s)
    return {name: [max(r[name][i] for r in per_rank) for i in range(args.steps)] for name in per_rank[0]}
