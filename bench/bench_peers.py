"""Side by side with peers' tables: ours at or below their step time at equal memory counted until W.

For every table recorded in ``bench/data`` (torch.distributed.pipelining's ZBV and DualPipe-V, Primus's
ZBV, V-half, V-min, zero-bubble and zero-bubble heuristic; see ``bench/peer_orders.py``) and every cost
ratio in :data:`COSTS`, simulate the peer's table and ours for the same shape under the same cost model,
with memory counted as Primus counts it (each microbatch from its F until its W, whole:
``w_retained_fraction = 1``). Ours is the matching algorithm (:data:`COUNTERPART`); where the peer's
table holds more than that algorithm's budget, ``zb-auto`` at the peer's memory is timed as well.
Writes JSON (default bench/results/peers.json) and a markdown table (stdout or --markdown)::

    python bench/bench_peers.py [--output PATH] [--markdown PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from write_results import markdown_table, run_bench  # noqa: E402
from peer_orders import PRIMUS_FILE, TORCH_FILE, peer_tables  # noqa: E402

from primuspipe.algorithms.build import build_schedule  # noqa: E402
from primuspipe.ir.activations import peak_in_flight  # noqa: E402
from primuspipe.ir.cost_model import MemoryCost  # noqa: E402
from primuspipe.simulator import CostModel, simulate  # noqa: E402

COSTS = {"F=B=W": (1.0, 1.0, 1.0), "B:W=1.5:0.5": (1.0, 1.5, 0.5), "B=2F W=F": (1.0, 2.0, 1.0)}
"""Per 1F1B stage (a chunk of a V-shape costs half)."""

COUNTERPART = {"ZBV": "zbv", "zbv-formatted": "zbv", "v-half": "v-half", "v-min": "v-min", "DualPipeV": "dualpipe-v",
               "zero-bubble": "zb-h1", "zero-bubble-heuristic": "zb-auto"}
"""Peer algorithm -> ours."""


def peer_cost(pp: int, vpp: int, f: float, b: float, w: float) -> CostModel:
    """The comparison's cost model: per 1F1B stage times, free P2P, memory counted whole until W."""
    return CostModel.per_stage(pp, f, b, w, memory=MemoryCost(1.0)).for_shape(pp, vpp)


def compare(entry: dict, theirs, costs: str) -> dict:
    f, b, w = COSTS[costs]
    pp, vpp, m = entry["pp"], entry["vpp"], entry["microbatches"]
    cost = peer_cost(pp, vpp, f, b, w)
    their_memory = max(peak_in_flight(theirs, 1.0))
    row = {"peer": theirs.algorithm.split()[0], "algorithm": entry["algorithm"], "pp": pp, "microbatches": m,
           "costs": costs, "their_step": simulate(theirs, cost).step_time, "their_memory": their_memory}
    if "planned_with" in entry:  # a cost-aware peer table: the costs it was built for
        planned = entry["planned_with"]
        row["planned_for"] = next(n for n, c in COSTS.items() if c == (planned["f"], planned["b"], planned["w"]))
    name = COUNTERPART[entry["algorithm"]]
    limit = their_memory if name == "zb-auto" else None
    ours = build_schedule(name, pp, m, vpp if name != "zb-auto" else None, cost=cost, memory_limit=limit)
    result = simulate(ours, cost.for_shape(pp, ours.vpp))
    row.update(ours=name, our_step=result.step_time, our_memory=max(peak_in_flight(ours, 1.0)))
    return row


def measure() -> list[dict]:
    rows = []
    for path in (TORCH_FILE, PRIMUS_FILE):
        for entry, table in peer_tables(path):
            for costs in COSTS:
                rows.append(compare(entry, table, costs))
    return rows


def markdown(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        behind = r["our_step"] > r["their_step"] + 1e-9 or r["our_memory"] > r["their_memory"] + 1e-9
        planned = f" (planned for {r['planned_for']})" if "planned_for" in r else ""
        return [f"{r['peer']} {r['algorithm']}{planned}", str(r["pp"]), str(r["microbatches"]), r["costs"],
                f"{r['their_step']:g} / {r['their_memory']:g}", r["ours"],
                f"{r['our_step']:g} / {r['our_memory']:g}{' **(behind)**' if behind else ''}"]

    table = markdown_table(["peer table", "pp", "m", "costs", "theirs: step / memory", "ours", "ours: step / memory"],
                           map(cells, rows))
    return table + "\nMemory: peak microbatches of one 1F1B stage per rank, each counted from its F until its W.\n"


def main() -> None:
    def produce() -> tuple[dict, str]:
        rows = measure()
        return {"costs": COSTS, "results": rows}, markdown(rows)

    run_bench(__doc__, "peers", produce)


if __name__ == "__main__":
    main()
