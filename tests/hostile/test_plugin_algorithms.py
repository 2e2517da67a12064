"""Algorithms a user registers (a plug-in's) that return what no runner can run: not a table, a table of another
shape or with communication already in it, rows of node texts or None, nodes past the table's microbatches or
chunks (an IndexError deep in the communication pass), and rows a node short, a node twice, a backward before its
forward, a W before its B, ranks that wait on each other. Each is refused by ``build_schedule`` and by the CLI
that names the algorithm, one line naming the algorithm or the rank and node; the same rows built by hand are
refused by ``simulate``, which timed them as given (a BW before its own F ran in a 15-unit step).

The cases are generated from the built-in algorithms' own tables (every shape family: 1F1B, split backward,
interleaved, V-shape, overlapped pairs), each mutation at the first, middle and last node of every rank."""

from __future__ import annotations

import itertools

import pytest

from hostile_support import refused, run_api, run_cli
from primuspipe.algorithms import ScheduleRequest, get_algorithm, register
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.node import BW, F, ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.simulator import simulate

BASES = [("1f1b", 3, 4, None), ("zb-h1", 3, 4, None), ("interleaved-1f1b", 2, 4, 2), ("zbv", 2, 4, None),
         ("dualpipe-v", 2, 4, None)]
"""(algorithm, pp, microbatches, vpp): a table of each family the validator knows."""


def _compute(base) -> ScheduleTable:
    name, pp, m, vpp = base
    return build_schedule(name, pp, m, vpp, communication=False)


def _backwards(row) -> list[int]:
    """Positions of the nodes that need a forward this rank ran earlier (B, W, BW, and overlapped pairs)."""
    return [i for i, n in enumerate(row) if any(k.name != "F" for k, _, _ in n.parts())]


def _node_mutations(table: ScheduleTable):
    """(label, rows) for rows that are wrong at one node: each mutation at the first, middle and last node of
    every rank (a backward moved before its forward: the first and last backward)."""
    m, vpp = table.microbatches, table.vpp
    for rank, row in enumerate(table.ranks):
        row = list(row)
        for i in sorted({0, len(row) // 2, len(row) - 1}):
            node = row[i]
            mutated = {
                "dropped": row[:i] + row[i + 1:],
                "twice": row[:i + 1] + row[i:],
                "microbatch past the table": row[:i] + [ScheduleNode(node.kind, m, node.chunk, pair=node.pair)]
                + row[i + 1:],
                "chunk past the table": row[:i] + [ScheduleNode(node.kind, node.microbatch, vpp, pair=node.pair)]
                + row[i + 1:],
                "node text": row[:i] + [str(node)] + row[i + 1:],
                "None": row[:i] + [None] + row[i + 1:],
            }
            for what, new in mutated.items():
                yield f"rank {rank} node {i} {what}", [new if r == rank else list(x) for r, x in enumerate(table.ranks)]
        for i in sorted({(b := _backwards(row))[0], b[-1]}):
            moved = [row[i]] + row[:i] + row[i + 1:]
            yield f"rank {rank} node {i} before its forward", [moved if r == rank else list(x)
                                                                for r, x in enumerate(table.ranks)]
        for i, node in enumerate(row):
            if node.kind.name == "W":
                b = next(j for j, n in enumerate(row) if (n.kind.name, n.microbatch, n.chunk) ==
                         ("B", node.microbatch, node.chunk))
                moved = row[:b] + [node] + row[b:i] + row[i + 1:]
                yield f"rank {rank} W{node.microbatch}.{node.chunk} before its B", [
                    moved if r == rank else list(x) for r, x in enumerate(table.ranks)]
                break


def _wait_cycles():
    """Rows where rank 0 alternates F and BW (1F1B with no warm-up) while the later ranks run every forward first:
    rank 0's first backward waits for rank 1's, which waits for rank 0's second forward."""
    for pp, m in itertools.product((2, 3, 4), (2, 3, 5)):
        first = [n for i in range(m) for n in (F(i), BW(i))]
        rest = [F(i) for i in range(m)] + [BW(i) for i in range(m)]
        yield f"pp={pp} m={m} wait cycle", (pp, m), [first] + [list(rest) for _ in range(pp - 1)]


def _cases():
    for base in BASES:
        table = _compute(base)
        for label, rows in _node_mutations(table):
            yield f"{base[0]} {label}", base, rows
    for label, (pp, m), rows in _wait_cycles():
        yield label, ("1f1b", pp, m, None), rows


CASES = list(_cases())
_names = itertools.count()


def _registered(base, returns) -> str:
    """A plug-in algorithm of ``base``'s placement whose function returns ``returns(request)``."""
    info = get_algorithm(base[0])
    name = f"hostile-plugin-{next(_names)}"

    def build(req: ScheduleRequest) -> ScheduleTable:
        """A hostile plug-in."""
        return returns(req)

    build.__module__ = "hostile_plugin"
    register(name, placement=info.placement, vpp=info.vpp, split_backward=info.split_backward)(build)
    return name


pytestmark = pytest.mark.usefixtures("forget_plugins")  # conftest.py


def _shape(base) -> list[str]:
    name, pp, m, vpp = base
    return ["--pp", str(pp), "-m", str(m), *([] if vpp is None else ["--vpp", str(vpp)])]


@pytest.mark.parametrize("label, base, rows", CASES, ids=[c[0] for c in CASES])
def test_rows_no_runner_can_run(label, base, rows):
    """A plug-in returning the rows: refused by build_schedule, by ``primuspipe show``, and, built by hand, by
    simulate -- each naming the rank (or the algorithm, for what is not a node at all)."""
    placement, m = _compute(base).placement, base[2]

    def returns(req):
        return ScheduleTable.build(placement, m, rows, "hostile")

    name = _registered(base, returns)
    pp, vpp = base[1], base[3]
    refused(run_api(build_schedule, name, pp, m, vpp), "rank", case=f"plug-in {label}")
    refused(run_cli(["show", name, *_shape(base)]), "rank", case=f"show plug-in {label}")
    try:
        table = ScheduleTable.build(placement, m, rows)
    except Exception:  # noqa: BLE001 - not a table at all: the node-entry check above refused it already
        return
    cost = CostModel.per_stage(placement.num_stages, 1.0, 1.0, 1.0)
    refused(run_api(simulate, table, cost), "rank", case=f"simulate hand-built {label}")


def _returns():
    """(label, names, function of the request) for results that are no compute table of the request."""
    def table(algorithm, **shape):
        return lambda req: build_schedule(algorithm, **{"pp": req.pp, "microbatches": req.microbatches,
                                                        "communication": False, **shape})

    yield "None", ["None", "ScheduleTable"], lambda req: None
    yield "rows", ["list", "ScheduleTable"], lambda req: [list(r) for r in table("1f1b")(req).ranks]
    yield "JSON", ["dict", "ScheduleTable"], lambda req: table("1f1b")(req).to_dict()
    yield "JSON text", ["ScheduleTable"], lambda req: table("1f1b")(req).to_json()
    yield "with communication", ["SEND/RECV"], lambda req: build_schedule("1f1b", req.pp, req.microbatches)
    yield "one rank more", ["pp="], lambda req: table("1f1b", pp=req.pp + 1)(req)
    yield "a microbatch more", ["microbatches="], lambda req: table("1f1b", microbatches=req.microbatches + 1)(req)
    yield "two chunks", ["vpp="], lambda req: table("interleaved-1f1b", vpp=2)(req)
    yield "flat row", ["rows"], lambda req: ScheduleTable.build(Placement.interleaved(req.pp), req.microbatches,
                                                                [F(0), BW(0)])
    yield "row of text", ["rank 0"], lambda req: ScheduleTable.build(Placement.interleaved(req.pp), req.microbatches,
                                                                     ["F0.0 BW0.0"] * req.pp)
    yield "a node a million times", ["repeated"], lambda req: ScheduleTable.build(  # round ten: validated for 30 s
        Placement.interleaved(req.pp), req.microbatches,
        [[F(0)] * 10**6 + list(row) for row in table("1f1b")(req).ranks])


RETURNS = list(_returns())


@pytest.mark.parametrize("label, names, returns", RETURNS, ids=[r[0] for r in RETURNS])
@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (4, 8)])
def test_results_that_are_no_table_of_the_request(label, names, returns, pp, m):
    name = _registered(("1f1b", pp, m, None), returns)
    refused(run_api(build_schedule, name, pp, m), *names, case=f"plug-in returns {label}")
    refused(run_cli(["show", name, "--pp", pp, "-m", m]), *names, case=f"show plug-in returning {label}")
