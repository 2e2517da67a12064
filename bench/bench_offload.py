"""Offload in the simulator: V-half and V-min under memory limits below their own peak, and what it costs.

For every shape in :data:`SHAPES`, cost ratio in :data:`COSTS` and host link in :data:`LINKS`, build the
algorithm's table, then run the offload pass (:func:`primuspipe.passes.offload.offload_activations`) at
each limit from half a microbatch below the table's own peak down to the lowest the pass can reach, and
simulate the result: the peak it reaches (1F1B-stage microbatches, counted until W at the default
``w_retained_fraction`` 32/34, offloads freeing when their copies end), the step time and its cost
against the table without offload, and the OFFLOAD count. A link is named by how long one chunk's copy
takes against that chunk's F (``copy = F`` moves a chunk's activations in the time its forward takes;
an H100's PCIe 5 link moves ~50 GB/s each way, so a 1 GB chunk activation against a 20 ms chunk F is
about ``copy = F``). Writes JSON (default bench/results/offload.json, every limit) and a markdown table (per
case: the lowest limit met, the step there, and the worst time cost over the limits met)::

    python bench/bench_offload.py [--output PATH] [--markdown PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.algorithms.build import build_schedule  # noqa: E402
from primuspipe.ir.kinds import NodeKind  # noqa: E402
from primuspipe.passes.offload import OffloadError, offload_activations  # noqa: E402
from primuspipe.simulator import CostModel, simulate  # noqa: E402

ALGORITHMS = ("v-half", "v-min")
SHAPES = ((4, 8), (8, 16), (8, 32))
"""(pp, microbatches)."""
COSTS = {"F=B=W": (1.0, 1.0, 1.0), "B:W=1.5:0.5": (1.0, 1.5, 0.5)}
"""Per 1F1B stage (a V-shape's chunk costs half)."""
LINKS = {"copy = F/2": 0.5, "copy = F": 1.0, "copy = 2F": 2.0}
"""One chunk's copy time over its forward time."""
ACTIVATION_BYTES = 1e9
"""One 1F1B-stage microbatch's activations (the unit only scales the link's bandwidth)."""


def cost_model(pp: int, f: float, b: float, w: float, copy_over_f: float) -> CostModel:
    """The model for a V-shape (vpp 2): a chunk of ``ACTIVATION_BYTES / 2`` copies in ``copy_over_f * f / 2``."""
    return CostModel.from_dict({"compute": {"f": f, "b": b, "w": w},
                                "memory": {"activation_bytes": ACTIVATION_BYTES, "w_retained_fraction": 32 / 34},
                                "host_link": {"latency": 0.0, "bandwidth": ACTIVATION_BYTES / (copy_over_f * f)}},
                               pp=pp, vpp=2)


def rows_for(algorithm: str, pp: int, m: int, costs: str, link: str) -> list[dict]:
    cost = cost_model(pp, *COSTS[costs], LINKS[link])
    table = build_schedule(algorithm, pp, m, cost=cost)
    base = simulate(table, cost)
    own = max(base.peak_activations)
    rows, limit = [], own - 0.5
    while limit > 0:
        row = {"algorithm": algorithm, "pp": pp, "microbatches": m, "costs": costs, "link": link,
               "own_peak": own, "own_step": base.step_time, "limit": limit}
        try:
            lean = offload_activations(table, cost, memory_limit=limit)
        except OffloadError as exc:
            rows.append({**row, "error": str(exc).split(";")[0]})
            break
        result = simulate(lean, cost)
        rows.append({**row, "peak": max(result.peak_activations), "step": result.step_time,
                     "time_cost": result.step_time / base.step_time - 1,
                     "offloads": sum(n.kind is NodeKind.OFFLOAD for r in lean.ranks for n in r)})
        limit -= 0.5
    return rows


def produce() -> tuple[dict, str]:
    rows = [row for algorithm in ALGORITHMS for pp, m in SHAPES for costs in COSTS for link in LINKS
            for row in rows_for(algorithm, pp, m, costs, link)]
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["algorithm"], r["pp"], r["microbatches"], r["costs"], r["link"]), []).append(r)
    lines = []
    for (algorithm, pp, m, costs, link), runs in cases.items():
        met = [r for r in runs if "error" not in r]
        low = met[-1] if met else None
        lines.append([algorithm, str(pp), str(m), costs, link, f"{runs[0]['own_peak']:g}", f"{runs[0]['own_step']:g}",
                      f"{low['peak']:.3g}" if low else "-", f"{low['step']:g}" if low else "-",
                      f"{max(r['time_cost'] for r in met):+.1%}" if met else "-", str(low["offloads"]) if low else "-"])
    table = markdown_table(["algorithm", "pp", "m", "costs", "link", "own peak", "own step", "lowest peak met",
                            "step there", "worst time cost", "offloads there"], lines)
    return {"rows": rows}, table


def main() -> None:
    run_bench(__doc__, "offload", produce)


if __name__ == "__main__":
    main()
