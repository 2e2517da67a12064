"""Bubble rate and peak activation memory of every schedule, pp in {4, 8, 16, 32}, m in {pp, 2pp, 4pp};
and V-min at pp 12, 16 and 24 beside Primus's own V-min tables (bench/data/primus_orders.json).

F = B = W = 1 per 1F1B stage (a chunk of a vpp = 2 schedule costs 1/2), free P2P, FB pairs without
overlap gain; memory counted as the device holds it, each microbatch from its F until its W (the
default cost model: W keeps 32/34 of B's activations; the V-min comparison counts whole microbatches
until W, as Primus does). Two bubble figures per schedule: over the whole step ("step", what the
simulator reports) and over each rank's own span, first start to last end ("span", the zero-bubble
papers' figure, which does not count the start-up wait of ranks further down the pipeline). zb-auto
(no memory limit, default work bounds) picks its placement per shape; it is not run at pp = 32, where
its search takes minutes. Writes JSON (default bench/results/schedules.json) and markdown tables
(stdout, or --markdown PATH)::

    python bench/bench_schedules.py [--output PATH] [--markdown PATH]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from write_results import markdown_table, run_bench  # noqa: E402
from peer_orders import peer_tables  # noqa: E402

from primuspipe.algorithms.build import build_schedule  # noqa: E402
from primuspipe.errors import ScheduleShapeError  # noqa: E402
from primuspipe.ir.cost_model import MemoryCost  # noqa: E402
from primuspipe.simulator import CostModel, simulate  # noqa: E402

ALGORITHMS = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2), ("v-half", 2),
              ("v-min", 2), ("dualpipe-v", 2), ("zb-auto", None)]
SHAPES = [(pp, m) for pp in (4, 8, 16, 32) for m in (pp, 2 * pp, 4 * pp)]
ZB_AUTO_MAX_PP = 16
V_MIN_SHAPES = [(12, 36), (16, 64), (24, 96)]


def measure(algorithm: str, vpp: int | None, pp: int, m: int, memory: MemoryCost = MemoryCost()) -> dict:
    row = {"algorithm": algorithm, "pp": pp, "vpp": vpp, "microbatches": m}
    if algorithm == "zb-auto" and pp > ZB_AUTO_MAX_PP:
        return {**row, "error": f"not run above pp = {ZB_AUTO_MAX_PP}"}
    cost = CostModel.per_stage(pp, 1.0, 1.0, 1.0, memory=memory)
    start = time.perf_counter()
    try:
        table = build_schedule(algorithm, pp, m, vpp, cost=cost)
    except ScheduleShapeError as exc:
        return {**row, "error": str(exc)}
    build_s = time.perf_counter() - start
    result = simulate(table, cost.for_shape(pp, table.vpp))
    return {**row, "vpp": table.vpp, "placement": table.placement.name, "build_s": round(build_s, 4),
            "step_time": result.step_time, "bubble_rate": round(result.bubble_rate, 4),
            "bubble_rate_mean": round(result.bubble_rate_mean, 4), "span_bubble_rate": round(result.span_bubble_rate, 4),
            "peak_activations": round(max(result.peak_activations), 4)}


def v_min_comparison() -> list[dict]:
    """Ours and Primus's V-min at pp 12, 16, 24, memory counted in whole microbatches until W."""
    primus = {(e["pp"], e["microbatches"]): t for e, t in peer_tables() if e["algorithm"] == "v-min"}
    rows = []
    for pp, m in V_MIN_SHAPES:
        cost = CostModel.per_stage(pp, 1.0, 1.0, 1.0, memory=MemoryCost(1.0)).for_shape(pp, 2)
        theirs = simulate(primus[(pp, m)], cost)
        ours = measure("v-min", 2, pp, m, MemoryCost(1.0))
        rows.append({"pp": pp, "microbatches": m, "budget": (pp + 4) // 3, "ours": ours,
                     "primus": {"step_time": theirs.step_time, "bubble_rate": round(theirs.bubble_rate, 4),
                                "peak_activations": max(theirs.peak_activations)}})
    return rows


def markdown(rows: list[dict]) -> str:
    by_key = {(r["algorithm"], r["pp"], r["microbatches"]): r for r in rows}

    def cell(r: dict, pick: bool) -> str:
        if "error" in r:
            return "not run" if r["error"].startswith("not run") else "refused"
        chosen = f" ({'V' if r['placement'] == 'v' else 'vpp ' + str(r['vpp'])})" if pick else ""
        return f"{r['bubble_rate']:.3f} / {r['span_bubble_rate']:.3f} / {r['peak_activations']:.3g}{chosen}"

    table = markdown_table(["algorithm", "vpp", *(f"pp={pp} m={m}" for pp, m in SHAPES)],
                           ([algorithm, str(vpp or "its pick"), *(cell(by_key[(algorithm, pp, m)], vpp is None)
                                                                  for pp, m in SHAPES)] for algorithm, vpp in ALGORITHMS))
    return table + "\nCells: bubble rate over the step / over each rank's own span / peak activations " \
                   "(1F1B-stage microbatches, worst rank, each counted from its F until its W).\n"


def v_min_markdown(rows: list[dict]) -> str:
    def figures(r: dict) -> str:
        return f"{r['step_time']:g} / {r['bubble_rate']:.3f} / {r['peak_activations']:g}"

    table = markdown_table(["V-min", "budget", "ours: step / bubble / memory", "Primus: step / bubble / memory"],
                           ([f"pp={r['pp']} m={r['microbatches']}", str(r["budget"]), figures(r["ours"]),
                             figures(r["primus"])] for r in rows))
    return table + "\nF = B = W; memory: whole microbatches until W (Primus's count), worst rank.\n"


def main() -> None:
    def produce() -> tuple[dict, str]:
        rows = [measure(a, vpp, pp, m) for a, vpp in ALGORITHMS for pp, m in SHAPES]
        v_min = v_min_comparison()
        return ({"costs": "F = B = W = 1 per 1F1B stage, P2P 0",
                 "memory": "counted until W; W keeps 32/34 (V-min comparison: whole microbatches)",
                 "results": rows, "v_min_vs_primus": v_min}, markdown(rows) + "\n" + v_min_markdown(v_min))

    run_bench(__doc__, "schedules", produce)


if __name__ == "__main__":
    main()
