"""Peers' node orders, recorded as data: torch.distributed.pipelining's ZBV and DualPipe-V, Primus's
zero-bubble family.

``bench/data/torch_orders.json`` is written by this script from the installed torch (its schedule
classes compute every rank's order without a process group, so this needs no GPU and no processes)::

    python bench/peer_orders.py            # rewrite bench/data/torch_orders.json

``bench/data/primus_orders.json`` was generated once by running Primus's own schedulers (the
repository and commit are in the file), outside this repository; only the resulting orders are kept.

Both files hold, per table, the algorithm, the shape, the placement and every rank's compute nodes in
primuspipe's text form (``F3.1`` forward of microbatch 3 on chunk 1, ``B`` input grad, ``W`` weight
grad, ``F7.0+B3.1`` an overlapped pair), so :func:`peer_tables` turns them into tables the simulator
times exactly as it times ours (``bench/bench_peers.py``, ``tests/algorithms/test_peers.py``).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

DATA = Path(__file__).parent / "data"
TORCH_FILE = DATA / "torch_orders.json"
PRIMUS_FILE = DATA / "primus_orders.json"

TORCH_SHAPES = [(pp, m) for pp in (4, 8) for m in (pp, pp + 1, 2 * pp + 1, 4 * pp)]
"""issue 13's grid: pp in {4, 8}, m in {p, p+1, 2p+1, 4p}."""


def peer_tables(path: Path = PRIMUS_FILE):
    """``(entry, table)`` per recorded table; ``entry`` keeps the file's fields (algorithm, source, ...)."""
    from primuspipe.ir.node import ScheduleNode
    from primuspipe.ir.placement import Placement
    from primuspipe.ir.table import ScheduleTable

    data = json.loads(Path(path).read_text())
    for entry in data["tables"]:
        placement = Placement.named(entry["placement"], entry["pp"], entry["vpp"])
        rows = [[ScheduleNode.parse(text) for text in row.split()] for row in entry["rows"]]
        yield entry, ScheduleTable.build(placement, entry["microbatches"], rows, f"{data['peer']} {entry['algorithm']}")


def torch_rows(schedule_class, pp: int, m: int) -> list[str]:
    """Every rank's compute order of a torch V-shape schedule, in primuspipe's text form."""
    import torch
    from torch.distributed.pipelining import schedules

    num_stages = 2 * pp

    def stage(index: int):  # what the schedule classes read from a stage to compute their orders
        return types.SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, stage_index=index,
                                     is_first=index == 0, is_last=index == num_stages - 1, submod=torch.nn.Identity())

    order = schedule_class([stage(0), stage(num_stages - 1)], m, loss_fn=lambda out, target: out).pipeline_order

    def chunk(stage_index: int) -> int:
        return 0 if stage_index < pp else 1

    def text(action) -> list[str]:
        kind = action.computation_type
        if kind == schedules.OVERLAP_F_B:  # a forward overlapped with a *full* backward: our FB, then its W
            f, b = action.sub_actions
            return [f"F{f.microbatch_index}.{chunk(f.stage_index)}+B{b.microbatch_index}.{chunk(b.stage_index)}",
                    f"W{b.microbatch_index}.{chunk(b.stage_index)}"]
        mb, c = action.microbatch_index, chunk(action.stage_index)
        names = {schedules.FORWARD: ["F"], schedules.BACKWARD_INPUT: ["B"], schedules.BACKWARD_WEIGHT: ["W"],
                 schedules.FULL_BACKWARD: ["B", "W"]}
        if kind not in names:
            return []  # communication, REDUCE_GRAD and the like: not compute
        return [f"{n}{mb}.{c}" for n in names[kind]]

    return [" ".join(t for a in order[rank] if a is not None for t in text(a)) for rank in range(pp)]


def write_torch_orders(path: Path = TORCH_FILE) -> int:
    import torch
    from torch.distributed.pipelining import schedules

    tables = []
    for name, cls, needs in (("ZBV", schedules.ScheduleZBVZeroBubble, 1), ("DualPipeV", schedules.ScheduleDualPipeV, 2)):
        for pp, m in TORCH_SHAPES:
            if m < needs * pp:
                continue  # DualPipeV needs m >= 2 pp
            tables.append({"algorithm": name, "source": f"torch.distributed.pipelining.schedules.{cls.__name__}",
                           "pp": pp, "vpp": 2, "placement": "v", "microbatches": m, "rows": torch_rows(cls, pp, m)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "peer": "torch", "torch_version": torch.__version__,
        "node_text": "F3.1 = forward of microbatch 3 on chunk 1; B input grad (torch's I); W weight grad; torch's full "
                     "backward B = our B then W; its OVERLAP_F_B (F with a full backward) = our FB node then the W",
        "tables": tables}, indent=1) + "\n")
    return len(tables)


if __name__ == "__main__":
    sys.exit(print(f"wrote {write_torch_orders()} tables to {TORCH_FILE}"))
