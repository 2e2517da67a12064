"""How often each zero-bubble algorithm's table is its paper's schedule, and how far apart they are.

Every table of zb-h1, zb-h2, zbv, v-half and v-min records which candidate construction won and the
simulated step of the paper's schedule written out in the code (the ZB-H1/ZB-H2 pattern, ZBV's
hand-crafted order, the V-min and V-half blocks). Over pp in {4, 8}, m in {2pp, 4pp}, five F:B:W cost
shapes and P2P 0 or 0.1 of F, this counts per algorithm the shapes where the chosen table is the
paper's, where another candidate ties it or beats it, or is beaten by it (which cannot happen since the
paper's schedule competes last; the column shows it), and the largest gap. Writes JSON (default
bench/results/constructions.json) and a markdown table::

    python bench/bench_constructions.py [--output PATH] [--markdown PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.algorithms.build import build_schedule  # noqa: E402
from primuspipe.simulator import CostModel  # noqa: E402

ALGORITHMS = ["zb-h1", "zb-h2", "zbv", "v-half", "v-min"]
SHAPES = [(pp, m) for pp in (4, 8) for m in (2 * pp, 4 * pp)]
COSTS = [(1, 1, 1), (1, 2, 1), (1, 1, 0.5), (2, 1, 1), (1, 1.5, 0.25)]
P2P = (0.0, 0.1)


def measure(algorithm: str, pp: int, m: int, costs: tuple[float, float, float], p2p: float) -> dict:
    link = {"latency": p2p}
    spec = {"compute": dict(zip("fbw", costs)), "p2p": {"intra_node": link, "inter_node": link}}
    vpp = 1 if algorithm.startswith("zb-h") else 2
    record = build_schedule(algorithm, pp, m, vpp, cost=CostModel.from_dict(spec, pp=pp, vpp=vpp)).construction
    return {"algorithm": algorithm, "pp": pp, "microbatches": m, "f_b_w": list(costs), "p2p": p2p,
            "chosen": record.name, "step_time": record.step_time, "candidates": record.candidates,
            "paper": record.paper, "paper_step_time": record.paper_step_time}


def outcome(row: dict) -> str:
    if row["chosen"] == row["paper"]:
        return "paper"
    if row["paper_step_time"] is None:
        return "paper does not run"
    gap = row["paper_step_time"] - row["step_time"]
    return "tie" if abs(gap) <= 1e-9 else ("winner faster" if gap > 0 else "paper faster")


def markdown(rows: list[dict]) -> str:
    kinds = ["paper", "tie", "winner faster", "paper faster", "paper does not run"]
    lines = []
    for algorithm in ALGORITHMS:
        mine = [r for r in rows if r["algorithm"] == algorithm]
        counts = [sum(outcome(r) == k for r in mine) for k in kinds]
        gaps = [(r["paper_step_time"] - r["step_time"]) / r["step_time"] for r in mine if r["paper_step_time"]]
        lines.append([algorithm, str(len(mine)), *map(str, counts),
                      f"{100 * max(gaps):+.1f} % / {100 * min(gaps):+.1f} %" if gaps else "-"])
    return markdown_table(["algorithm", "shapes", "is the paper's", "ties it", "beats it", "beaten by it",
                           "paper does not run", "paper vs chosen step: worst / best"], lines) + \
        "\nShapes: pp 4, 8; m = 2pp, 4pp; F:B:W 1:1:1, 1:2:1, 1:1:0.5, 2:1:1, 1:1.5:0.25; P2P 0, 0.1.\n"


def main() -> None:
    def produce() -> tuple[dict, str]:
        rows = [measure(a, pp, m, c, p) for a in ALGORITHMS for pp, m in SHAPES for c in COSTS for p in P2P]
        return {"results": rows}, markdown(rows)

    run_bench(__doc__, "constructions", produce)


if __name__ == "__main__":
    main()
