"""primuspipe's 1F1B vs megatron-core's native 1F1B: step time in the same run (CPU, gloo, pp=2).

    python bench/bench_runner.py [--microbatches 8] [--steps 80] [--hidden 64] [--seq 32] [--out bench/results/runner.json]

Two ranks, one thread each. Both schedules drive the same model chunks and data; steps alternate
(native, primuspipe, native, ...) after a warm-up so drift hits both equally. Reports per-rank medians
of the forward-backward call and the median of per-pair ratios primuspipe / native (target <= 1.02).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "runner.json"))
    args = p.parse_args()

    from primuspipe.backends.megatron import compare, tiny_models
    from primuspipe.backends.megatron.config import PrimusPipeConfig
    from primuspipe.backends.megatron.distributed_cpu import ParallelLayout, run_on_gloo
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward

    model = dataclasses.replace(tiny_models.TINY_MODELS["tiny-gpt"], hidden_size=args.hidden,
                                ffn_hidden_size=4 * args.hidden, num_attention_heads=4, seq_length=args.seq,
                                micro_batch_size=args.micro_batch_size, num_layers=args.layers, vocab_size=512)
    spec = compare.StepSpec(model, args.microbatches)

    def work(ctx):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        config, chunks, _ = compare.build(spec, 2, 1)
        schedules = {"native": get_forward_backward_func(), "primuspipe": PrimusForwardBackward(PrimusPipeConfig(True, "1f1b"))}
        times = {name: [] for name in schedules}
        for step in range(args.warmup + args.steps):
            order = ("native", "primuspipe") if step % 2 == 0 else ("primuspipe", "native")
            for name in order:
                for c in chunks:
                    c.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                schedules[name](forward_step_func=tiny_models.forward_step, data_iterator=compare.batches(spec),
                                model=chunks[0], num_microbatches=args.microbatches, seq_length=model.seq_length,
                                micro_batch_size=model.micro_batch_size)
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        return times

    per_rank = run_on_gloo(work, ParallelLayout(2), timeout_s=1800)
    # A step ends when its slowest rank ends: take the per-step max over ranks.
    native = [max(r["native"][i] for r in per_rank) for i in range(args.steps)]
    ours = [max(r["primuspipe"][i] for r in per_rank) for i in range(args.steps)]
    result = {
        "bench": "runner", "pp": 2, "vpp": 1, "algorithm": "1f1b", "microbatches": args.microbatches,
        "model": dataclasses.asdict(model), "steps": args.steps, "threads_per_rank": 1,
        "native_median_s": statistics.median(native), "primuspipe_median_s": statistics.median(ours),
        "ratio_median": statistics.median(o / n for o, n in zip(ours, native)),
        "ratio_of_medians": statistics.median(ours) / statistics.median(native),
        "native_s": native, "primuspipe_s": ours, "host": platform.node(), "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("native_median_s", "primuspipe_median_s", "ratio_median", "ratio_of_medians")}))


if __name__ == "__main__":
    main()
