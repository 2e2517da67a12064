"""A table's dependency graph (primuspipe.ir.graph) and its DOT export (``show --graph``).

The graph is checked against the two other readers of the dependency model: the validator (a compute
order validates exactly when its graph is acyclic, on generated orders) and the simulator (no node of a
shipped table starts before every node its graph says it waits for has finished)."""

import random

import networkx as nx
import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.algorithms.registry import list_algorithms
from primuspipe.cli import main
from primuspipe.errors import ValidationError
from primuspipe.ir.dataflow import step_needs
from primuspipe.ir.cost_model import CostModel, Link, P2PCost
from primuspipe.ir.graph import dependency_graph
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import BW, F
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.dot import to_dot
from primuspipe.passes.offload import offload_activations
from primuspipe.passes.validation import validate
from primuspipe.simulator import simulate


def _shipped(pp: int, m: int):
    for info in list_algorithms():
        for vpp in sorted({info.vpp or 1, info.vpp or 2}):
            try:
                yield build_schedule(info.name, pp, m, vpp)
            except Exception:  # a shape the algorithm does not take (m < 2pp, vpp fixed, ...)
                continue


TABLES = [t for pp, m in ((2, 4), (3, 7), (4, 8)) for t in _shipped(pp, m)]
OFFLOADED = offload_activations(build_schedule("v-min", 4, 8), CostModel.per_stage(8, 1, 1, 1), memory_limit=1.5)


@pytest.mark.parametrize("table", [*TABLES, OFFLOADED], ids=lambda t: f"{t.algorithm}-pp{t.pp}-vpp{t.vpp}-m{t.microbatches}")
def test_simulated_nodes_start_after_everything_their_graph_waits_for(table):
    cost = CostModel.per_stage(table.num_stages, [1 + 0.3 * s for s in range(table.num_stages)], 1.7, 0.6,
                               p2p=P2PCost(message_bytes=1e6, intra_node=Link(0.05, 1e7), inter_node=Link(0.05, 1e7)))
    result = simulate(table, cost)
    graph = dependency_graph(table)
    assert nx.is_directed_acyclic_graph(graph)
    assert set(graph) == {(r, i) for r, row in enumerate(table.ranks) for i, n in enumerate(row) if n.kind.is_compute}
    kinds = {k for _, _, k in graph.edges(data="kind")}
    p = table.placement
    hand_offs = any(p.rank_of(s) == p.rank_of(s + 1) for s in range(table.num_stages - 1))  # a V's turn
    assert "transfer" in kinds and ("local" in kinds) == hand_offs
    for (r, i), (s, j), data in graph.edges(data=True):
        finished, starts = result.ranks[r].ends[i], result.ranks[s].starts[j]
        assert finished <= starts + 1e-9, f"{table.ranks[s][j]} on rank {s} starts before {table.ranks[r][i]} ({data})"


def _shuffled_orders(seed: int):
    """Compute-only tables whose rows are the shipped rows in another order: some run, some deadlock,
    some break a rank's own order (a B before its F)."""
    rng = random.Random(seed)
    base = rng.choice([t for t in TABLES if t.pp <= 3]).compute_only()
    rows = [list(row) for row in base.ranks]
    for row in rows:
        for _ in range(rng.randint(0, 2)):  # a few swaps of neighbours keep many orders valid
            k = rng.randrange(len(row) - 1)
            row[k], row[k + 1] = row[k + 1], row[k]
        if rng.random() < 0.5:  # a forward moved later, still before its own backward: a peer may wait for it
            k = rng.choice([k for k, n in enumerate(row) if n.kind is NodeKind.F])
            own = next(j for j in range(k + 1, len(row)) if (row[k].microbatch, row[k].chunk) in
                       {(mb, chunk) for _, mb, chunk in row[j].parts()})
            row.insert(rng.randrange(k, own), row.pop(k))
    return base.with_ranks(rows)


@pytest.mark.parametrize("seed", range(80))
def test_an_order_validates_exactly_when_its_graph_is_acyclic(seed):
    table = _shuffled_orders(seed)
    graph = dependency_graph(table)
    try:
        validate(table)
        valid = True
    except ValidationError as exc:
        assert exc.rule in ("order", "deadlock"), exc
        valid = False
    assert nx.is_directed_acyclic_graph(graph) == valid
    if not valid:
        cycle = nx.find_cycle(graph)
        assert all(graph.edges[u, v]["kind"] in ("order", "stage", "local", "transfer") for u, v, *_ in cycle)


def test_a_cross_rank_deadlock_is_a_cycle_through_both_ranks():
    """Rank 1 runs microbatch 1 first, but rank 0 sends it only after mb 0's backward, which waits for
    rank 1's backward of mb 0: the cycle runs through both ranks' rows and both transfers."""
    table = ScheduleTable.build(Placement.interleaved(2, 1), 2, [[F(0), BW(0), F(1), BW(1)], [F(1), BW(1), F(0), BW(0)]])
    with pytest.raises(ValidationError, match="deadlock"):
        validate(table)
    cycle = nx.find_cycle(dependency_graph(table))
    assert {u[0] for u, _ in cycle} == {0, 1}
    edges = [dependency_graph(table).edges[u, v] for u, v in cycle]
    assert sorted(str(t) for e in edges for t in e["transfers"]) == [
        "activation of mb 1, stage 0 -> 1", "gradient of mb 0, stage 1 -> 0"]


EXPECTED_1F1B = """\
  "0:0" -> "0:3" [color="#9a9a9a"];
  "0:0" -> "1:1" [color="#c03030", penwidth=2, label="activation of mb 0, stage 0 -> 1"];
  "0:3" -> "0:6" [color="#9a9a9a"];
  "0:3" -> "1:5" [color="#c03030", penwidth=2, label="activation of mb 1, stage 0 -> 1"];
  "0:6" -> "0:7" [color="#9a9a9a"];
  "1:1" -> "1:3" [color="#9a9a9a"];
  "1:3" -> "1:5" [color="#9a9a9a"];
  "1:3" -> "0:6" [color="#c03030", penwidth=2, label="gradient of mb 0, stage 1 -> 0"];
  "1:5" -> "1:6" [color="#9a9a9a"];
  "1:6" -> "0:7" [color="#c03030", penwidth=2, label="gradient of mb 1, stage 1 -> 0"];
"""


def test_show_graph_writes_the_dot_of_the_table(capsys, tmp_path):
    """1F1B, pp=2, m=2 (rank 0: F0 F1 BW0 BW1; rank 1: F0 BW0 F1 BW1, with its sends and receives at
    the indices the full table has): every edge by hand."""
    assert main(["show", "1f1b", "--pp", "2", "-m", "2", "--graph"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('digraph "1f1b" {') and out.endswith("}\n")
    assert "".join(line + "\n" for line in out.splitlines() if "->" in line) == EXPECTED_1F1B
    assert '"0:6" [label="BW0.0"' in out and 'subgraph cluster_rank1' in out
    path = tmp_path / "g.dot"
    assert main(["show", "1f1b", "--pp", "2", "-m", "2", "--graph", str(path)]) == 0
    assert path.read_text() == out


def test_local_hand_offs_are_dashed_and_pairs_keep_both_parts_needs():
    table = build_schedule("dualpipe-v", 2, 4)
    dot = to_dot(table)
    graph = dependency_graph(table)
    locals_ = [(u, v) for u, v, k in graph.edges(data="kind") if k == "local"]
    assert locals_ and all(f'"{u[0]}:{u[1]}" -> "{v[0]}:{v[1]}" [color="#3060c0", style=dashed];' in dot for u, v in locals_)
    pairs = [(n, node) for n, node in graph.nodes(data="node") if node.pair is not None]
    assert pairs
    for (rank, i), node in pairs:  # every need of both parts is an edge in (none of them is the pair itself here)
        (f, f_mb, f_chunk), (b, b_mb, b_chunk) = node.parts()
        wanted = {*step_needs(table.placement, f, table.placement.stage(rank, f_chunk), f_mb),
                  *step_needs(table.placement, b, table.placement.stage(rank, b_chunk), b_mb)}
        assert {step for _, _, d in graph.in_edges((rank, i), data=True) for step in d["needs"]} == wanted
