"""Bubble rate and peak activation memory of every fixed schedule, pp in {4, 8, 16, 32}, m in {pp, 2pp, 4pp}.

F = B = W = 1 per 1F1B stage (a chunk of a vpp = 2 schedule costs 1/2), free P2P, FB pairs without
overlap gain. Two bubble figures per schedule: over the whole step ("step", what the simulator
reports) and over each rank's own span, first start to last end ("span", the zero-bubble papers'
figure, which does not count the start-up wait of ranks further down the pipeline). Writes JSON
(default bench/results/schedules.json) and a markdown table (stdout, or --markdown PATH)::

    python bench/bench_schedules.py [--output PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from primuspipe.errors import ScheduleShapeError
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, simulate

ALGORITHMS = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2), ("v-half", 2),
              ("v-min", 2), ("dualpipe-v", 2)]
SHAPES = [(pp, m) for pp in (4, 8, 16, 32) for m in (pp, 2 * pp, 4 * pp)]


def measure(algorithm: str, vpp: int, pp: int, m: int) -> dict:
    row = {"algorithm": algorithm, "pp": pp, "vpp": vpp, "microbatches": m}
    start = time.perf_counter()
    try:
        table = build_schedule(algorithm, pp, m, vpp)
    except ScheduleShapeError as exc:
        return {**row, "error": str(exc)}
    build_s = time.perf_counter() - start
    result = simulate(table, CostModel.per_stage(pp * vpp, 1 / vpp, 1 / vpp, 1 / vpp))
    return {**row, "build_s": round(build_s, 4), "step_time": result.step_time,
            "bubble_rate": round(result.bubble_rate, 4), "bubble_rate_mean": round(result.bubble_rate_mean, 4),
            "span_bubble_rate": round(result.span_bubble_rate, 4), "peak_activations": max(result.peak_activations)}


def markdown(rows: list[dict]) -> str:
    head = "| algorithm | vpp | " + " | ".join(f"pp={pp} m={m}" for pp, m in SHAPES) + " |"
    lines = [head, "|" + "---|" * (2 + len(SHAPES))]
    by_key = {(r["algorithm"], r["pp"], r["microbatches"]): r for r in rows}
    for algorithm, vpp in ALGORITHMS:
        cells = []
        for pp, m in SHAPES:
            r = by_key[(algorithm, pp, m)]
            cells.append("refused" if "error" in r else
                         f"{r['bubble_rate']:.3f} / {r['span_bubble_rate']:.3f} / {r['peak_activations']:g}")
        lines.append(f"| {algorithm} | {vpp} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nCells: bubble rate over the step / over each rank's own span / peak activations " \
                              "(1F1B-stage microbatches, worst rank).\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "schedules.json")
    parser.add_argument("--markdown", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    rows = [measure(a, vpp, pp, m) for a, vpp in ALGORITHMS for pp, m in SHAPES]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                       "costs": "F = B = W = 1 per 1F1B stage, P2P 0", "results": rows}, indent=1))
    table = markdown(rows)
    if args.markdown:
        args.markdown.write_text(table)
    else:
        sys.stdout.write(table)


if __name__ == "__main__":
    main()
