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
from pathlib import Path

from pipeline_bench import add_arguments, alternating_step_times, tiny_gpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, steps=80, hidden=64, seq=32, layers=8, out="runner.json")
    args = p.parse_args()

    def schedules():
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from primuspipe.backends.megatron.config import PrimusPipeConfig
        from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward

        return {"native": get_forward_backward_func(), "primuspipe": PrimusForwardBackward(PrimusPipeConfig(True, "1f1b"))}

    times = alternating_step_times(schedules, args, timeout_s=1800)
    native, ours = times["native"], times["primuspipe"]
    model = tiny_gpt(args)
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
