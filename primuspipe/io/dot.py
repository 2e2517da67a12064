"""A table's dependency graph (:mod:`primuspipe.ir.graph`) as Graphviz DOT text: one cluster per rank,
its nodes in row order; ``transfer`` edges bold and labelled with what they move, ``local`` hand-offs
dashed, the rows' order thin (a ``stage`` need, which the row's order already says on a valid table,
is drawn only where it is also the row's order). ``dot -Tsvg`` (Graphviz) draws it."""

from __future__ import annotations

import networkx as nx

from primuspipe.ir.graph import dependency_graph
from primuspipe.ir.table import ScheduleTable

_STYLE = {"order": 'color="#9a9a9a"', "stage": 'color="#9a9a9a"', "transfer": 'color="#c03030", penwidth=2', "local": 'color="#3060c0", style=dashed'}


def to_dot(table: ScheduleTable, graph: nx.DiGraph | None = None) -> str:
    """DOT text of ``table``'s dependency graph (``graph``, when the caller has built it already)."""
    graph = dependency_graph(table) if graph is None else graph
    title = (f"{table.algorithm}: pp={table.pp} vpp={table.vpp} microbatches={table.microbatches} "
             f"placement={table.placement.name}")
    lines = [f"digraph {_quote(table.algorithm)} {{", f"  label={_quote(title)};", "  labelloc=t;", "  rankdir=LR;",
             "  node [shape=box, style=filled, fontname=monospace];"]
    for rank in range(table.pp):
        lines += [f"  subgraph cluster_rank{rank} {{", f"    label={_quote(f'rank {rank}')};"]
        lines += [f"    {_id(n)} [label={_quote(str(node))}, fillcolor={_quote(node.kind.spec.color + '66')}];"
                  for n, node in graph.nodes(data="node") if n[0] == rank]
        lines.append("  }")
    for u, v, data in graph.edges(data=True):
        if data["kind"] == "stage" and not data["order"]:
            continue
        label = f", label={_quote('; '.join(map(str, data['transfers'])))}" if data["transfers"] else ""
        lines.append(f"  {_id(u)} -> {_id(v)} [{_STYLE[data['kind']]}{label}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _id(position: tuple[int, int]) -> str:
    return f'"{position[0]}:{position[1]}"'


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
