"""Split backward in real Megatron (CPU, gloo, pp=2): zb-h1 vs 1f1b step time, and B / W node times vs BW.

    python bench/bench_splitw.py [--microbatches 8] [--steps 20] [--hidden 256] [--seq 128] [--out bench/results/splitw.json]

Two ranks, one thread each, the same model and data through primuspipe's 1f1b and zb-h1 tables (steps
alternate after a warm-up). Node times come from ``dump_pp_data`` timelines of the same runs: if W
recomputed the input gradient it would cost about a whole BW; deferred, B + W ~ BW and W is only
the weight GEMMs. On CPU every op runs on one thread, so the zero-bubble gain in step time is what the
schedule's shorter bubbles give when F, B and W really are separate costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import statistics
import tempfile
from pathlib import Path

from pipeline_bench import add_arguments, alternating_step_times, tiny_gpt


def _node_medians(dump_dir: Path, iterations: range) -> dict[str, dict[str, float]]:
    """Median duration of each compute kind, per rank, over the given iterations' dumps."""
    from primuspipe.io.timeline import dump_path
    from primuspipe.io.timeline import Timeline

    per_kind: dict[str, dict[str, list[float]]] = {}
    for it in iterations:
        for path in sorted(dump_path(dump_dir, it, 0).parent.glob("rank_*.json")):
            for rank in Timeline.load(path).ranks:
                for e in rank.events:
                    if e.node.kind.is_compute:
                        per_kind.setdefault(f"rank{rank.rank}", {}).setdefault(e.node.kind.name, []).append(
                            e.end - e.start)
    return {r: {k: statistics.median(v) for k, v in kinds.items()} for r, kinds in per_kind.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, steps=20, hidden=256, seq=128, layers=4, out="splitw.json")
    args = p.parse_args()
    dump_root = Path(tempfile.mkdtemp(prefix="primuspipe-splitw-"))
    algorithms = ("1f1b", "zb-h1")

    def schedules():
        from primuspipe.backends.megatron.config import PrimusPipeConfig
        from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward

        return {a: PrimusForwardBackward(PrimusPipeConfig(True, a, dump_pp_data=True, dump_dir=str(dump_root / a)))
                for a in algorithms}

    step = alternating_step_times(schedules, args)
    model = tiny_gpt(args)
    measured = range(args.warmup, args.warmup + args.steps)
    nodes = {a: _node_medians(dump_root / a, measured) for a in algorithms}
    shutil.rmtree(dump_root, ignore_errors=True)
    b_plus_w = {r: nodes["zb-h1"][r]["B"] + nodes["zb-h1"][r]["W"] for r in nodes["zb-h1"]}
    result = {
        "bench": "splitw", "pp": 2, "microbatches": args.microbatches, "model": dataclasses.asdict(model),
        "steps": args.steps, "threads_per_rank": 1,
        "step_median_s": {a: statistics.median(step[a]) for a in algorithms},
        "zb_h1_over_1f1b_ratio_median": statistics.median(z / o for z, o in zip(step["zb-h1"], step["1f1b"])),
        "node_median_s": nodes,
        "w_over_bw": {r: nodes["zb-h1"][r]["W"] / nodes["1f1b"][r]["BW"] for r in b_plus_w},
        "b_plus_w_over_bw": {r: b_plus_w[r] / nodes["1f1b"][r]["BW"] for r in b_plus_w},
        "step_s": step, "host": platform.node(), "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("step_median_s", "zb_h1_over_1f1b_ratio_median", "w_over_bw",
                                              "b_plus_w_over_bw")}))


if __name__ == "__main__":
    main()
