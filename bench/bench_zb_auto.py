"""zb-auto against the best fixed algorithm that fits the memory limit, on a sweep of cost cases.

Each case is a shape, per-1F1B-stage F/B/W times (uniform, F:B:W skews, a slow first or last stage),
a P2P time (0 to 20 % of F) and a memory limit (from V-min's budget to 2p, or none), counted until W.
"Best fixed" is computed here from ``build_schedule`` and the simulator alone: every registered
algorithm but zb-auto, on every vpp it takes (1 and 2 for those that take any), whose table fits the
limit. zb-auto runs with its default work bounds and picks its placement. Writes JSON (default
bench/results/zb_auto.json) and a markdown table (stdout or --markdown)::

    python bench/bench_zb_auto.py [--output PATH] [--markdown PATH]

``tests/algorithms/test_zb_auto.py`` asserts the same comparison on the same cases.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.algorithms import ScheduleRequest, list_algorithms
from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.activations import peak_in_flight
from primuspipe.ir.cost_model import CostModel, Link, P2PCost
from primuspipe.search.zb_auto import zb_auto_search
from primuspipe.simulator import simulate

SLOW_FIRST = {4: [1.5, 1, 1, 1], 6: [1.5] + [1] * 5, 8: [1.5] + [1] * 7}
SLOW_LAST = {4: [1, 1, 1, 1.5], 6: [1] * 5 + [1.5], 8: [1] * 7 + [1.5]}

CASES = {
    # name: (pp, m, f, b, w, p2p, memory limit in 1F1B-stage microbatches counted until W)
    "uniform, no limit": (4, 8, 1, 1, 1, 0.0, None),
    "uniform, V-min's memory": (4, 8, 1, 1, 1, 0.0, 2),
    "uniform, V-half's memory": (4, 12, 1, 1, 1, 0.0, 3),
    "B twice F, 1F1B's memory": (4, 12, 1, 2, 1, 0.0, 4),
    "B:W 1.5:0.5, no limit": (4, 16, 1, 1.5, 0.5, 0.0, None),
    "slow last stage, P2P 5 %, 1F1B's memory": (4, 12, SLOW_LAST[4], 1.2, 0.8, 0.05, 4),
    "slow first stage, 2p": (4, 8, SLOW_FIRST[4], 1, 1, 0.0, 8),
    "P2P 20 %, 1F1B's memory": (4, 8, 1, 1, 1, 0.2, 4),
    "W heavy, V-half's memory": (4, 8, 1, 1, 2, 0.0, 3),
    "B:W 1.5:0.5, 1F1B's memory": (6, 18, 1, 1.5, 0.5, 0.0, 6),
    "uniform, V-min's memory, pp 6": (6, 12, 1, 1, 1, 0.0, 3),
    "P2P 10 %, between V-half and 1F1B": (6, 12, 1, 1, 1, 0.1, 4.5),
    "slow last stage, 2p": (6, 12, SLOW_LAST[6], SLOW_LAST[6], SLOW_LAST[6], 0.0, 12),
    "B twice F, 5 of 6": (6, 12, 1, 2, 1, 0.0, 5),
    "P2P 10 %, V-half's memory, pp 8": (8, 24, 1, 1, 1, 0.1, 5),
    "B:W 1.5:0.5, V-half's memory, pp 8": (8, 16, 1, 1.5, 0.5, 0.0, 5),
    "B:W 1.5:0.5, no limit, pp 8": (8, 32, 1, 1.5, 0.5, 0.0, None),
    "uniform, V-min's memory, pp 8": (8, 16, 1, 1, 1, 0.0, 4),
    "slow first stage, 1F1B's memory, pp 8": (8, 16, SLOW_FIRST[8], 1, 1, 0.0, 8),
    "P2P 5 %, B twice F, 2p": (8, 16, 1, 2, 1, 0.05, 16),
    "uniform, tiny": (3, 6, 1, 1, 1, 0.0, 2),
    "B twice F, two ranks": (2, 4, 1, 2, 1, 0.0, 2),
    "P2P 10 %, B:W 1.5:0.5, pp 5": (5, 10, 1, 1.5, 0.5, 0.1, 3),
    "between V-min and V-half, pp 8": (8, 16, 1, 1.5, 0.5, 0.0, 4.5),
}


def model(pp: int, f, b, w, p2p: float) -> CostModel:
    """Per-1F1B-stage times, the same P2P latency between every pair of ranks, the default memory model."""
    link = Link(p2p)
    return CostModel.per_stage(pp, f, b, w, p2p=P2PCost(intra_node=link, inter_node=link))


def best_fixed(pp: int, m: int, cost: CostModel, limit: float | None) -> tuple[float, str, int] | None:
    """(step, algorithm, vpp) of the fastest registered algorithm but zb-auto, on every vpp it takes (1
    and 2 for those that take any), whose table fits ``limit``; timed by the simulator under ``cost``."""
    best = None
    for info in list_algorithms():
        if info.name == "zb-auto":
            continue
        for vpp in [info.vpp] if info.vpp else [1, 2]:
            try:
                table = build_schedule(info.name, pp, m, vpp, cost=cost)
            except ScheduleShapeError:
                continue
            if limit is None or max(peak_in_flight(table)) <= limit + 1e-9:
                step = simulate(table, cost.for_shape(pp, vpp)).step_time
                best = min(best or (step, info.name, vpp), (step, info.name, vpp))
    return best


def measure(name: str) -> dict:
    pp, m, f, b, w, p2p, limit = CASES[name]
    cost = model(pp, f, b, w, p2p)
    start = time.perf_counter()
    table, report = zb_auto_search(ScheduleRequest(pp, None, m, cost, limit))
    search_s = time.perf_counter() - start
    step = simulate(table, cost.for_shape(pp, table.vpp)).step_time
    fixed_step, fixed_name, fixed_vpp = best_fixed(pp, m, cost, limit)
    return {"case": name, "pp": pp, "microbatches": m, "limit": limit, "zb_auto_step": step,
            "zb_auto_placement": "v" if table.placement.name == "v" else f"interleaved vpp={table.vpp}",
            "zb_auto_method": report.method, "zb_auto_source": report.source, "zb_auto_peak": report.peak_in_flight,
            "optimal": report.optimal, "search_s": round(search_s, 2), "best_fixed_step": fixed_step,
            "best_fixed": f"{fixed_name} (vpp {fixed_vpp})"}


def markdown(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        mark = "" if r["zb_auto_step"] <= r["best_fixed_step"] + 1e-9 else " **slower**"
        found = f"{r['zb_auto_placement']}, {r['zb_auto_method']}{', optimal' if r['optimal'] else ''}"
        return [r["case"], str(r["pp"]), str(r["microbatches"]), "none" if r["limit"] is None else f"{r['limit']:g}",
                f"{r['zb_auto_step']:.4g} ({found}){mark}", f"{r['best_fixed_step']:.4g} ({r['best_fixed']})"]

    return markdown_table(["case", "pp", "m", "limit", "zb-auto: step (placement, found by)",
                           "best fixed: step (algorithm)"], map(cells, rows))


def main() -> None:
    def produce() -> tuple[dict, str]:
        rows = [measure(name) for name in CASES]
        return {"results": rows}, markdown(rows)

    run_bench(__doc__, "zb_auto", produce)


if __name__ == "__main__":
    main()
