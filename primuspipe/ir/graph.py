"""A table's dependency graph: which node must finish before which, as a :class:`networkx.DiGraph`.

The graph holds a table's compute nodes (host copies included), keyed ``(rank, index)`` by their
position in the table's row -- the positions validation and the grid name. Its edges are the rows'
order and the one dependency model (:mod:`primuspipe.ir.dataflow`), each with a ``kind``:

* ``order``: a node follows the previous compute-stream node of its rank's row (a rank runs its row in
  order; a host copy is issued after that node, and the rank goes on without waiting for it);
* ``transfer``: a node needs a step another rank completes (an activation or a gradient a SEND/RECV
  pair moves; in a full table the pair realises the edge);
* ``local``: a node needs a step another chunk of its own rank completes (a hand-off, no message);
* ``stage``: a node needs a step of its own stage (a B its F, a W its B): on a valid table the row's
  order already says it (``order`` is True on such an edge when the two nodes are neighbours).

The graph is acyclic exactly when the table's compute order can run: a cycle is a node that would wait
for itself, through other ranks or its own row, and ``networkx.find_cycle`` names it. ``primuspipe show
ALGORITHM --graph`` writes it as DOT (:mod:`primuspipe.io.dot`); as a networkx graph it can be queried
with networkx's algorithms (paths, ancestors, cycles).

>>> from primuspipe.ir.node import F, BW
>>> from primuspipe.ir.placement import Placement
>>> from primuspipe.ir.table import ScheduleTable
>>> table = ScheduleTable.build(Placement.interleaved(2, 1), 1, [[F(0), BW(0)], [F(0), BW(0)]])
>>> sorted((u, v, k) for u, v, k in dependency_graph(table).edges(data="kind"))
[((0, 0), (0, 1), 'stage'), ((0, 0), (1, 0), 'transfer'), ((1, 0), (1, 1), 'stage'), ((1, 1), (0, 1), 'transfer')]
"""

from __future__ import annotations

import networkx as nx

from primuspipe.ir.dataflow import Step, Transfer, step_needs, steps_done
from primuspipe.ir.table import ScheduleTable


def dependency_graph(table: ScheduleTable) -> nx.DiGraph:
    """The graph of the module docstring. Nodes carry ``node`` (the :class:`~primuspipe.ir.node.ScheduleNode`)
    and ``rank``. Edges carry ``kind``, ``order`` (whether the row's order joins the two nodes), ``needs``
    (the :class:`~primuspipe.ir.dataflow.Step` s waited for; an overlapped pair may wait for two of one
    node) and ``transfers`` (the :class:`~primuspipe.ir.dataflow.Transfer` s moving them across ranks)."""
    placement = table.placement
    graph = nx.DiGraph(algorithm=table.algorithm, pp=table.pp, vpp=table.vpp, microbatches=table.microbatches)
    done_by: dict[Step, tuple[int, int]] = {}
    for rank, row in enumerate(table.ranks):
        previous = None  # the last compute-stream node so far
        for i, node in enumerate(row):
            if not node.kind.is_compute:
                continue
            graph.add_node((rank, i), node=node, rank=rank)
            if previous is not None:
                graph.add_edge(previous, (rank, i), kind="order", order=True, needs=(), transfers=())
            if not node.kind.on_host_stream:
                previous = (rank, i)
            for step in steps_done(placement, rank, node):
                done_by.setdefault(step, (rank, i))
    for (rank, i), node in graph.nodes(data="node"):
        for part in node.parts():
            stage = placement.stage(rank, part.chunk)
            for need in step_needs(placement, part.kind, stage, part.microbatch):
                if (source := done_by.get(need)) is None or source == (rank, i):
                    continue
                kind = "transfer" if source[0] != rank else "stage" if need.stage == stage else "local"
                moved = (Transfer(need.kind, need.stage, stage, need.microbatch),) if kind == "transfer" else ()
                if (edge := graph.get_edge_data(source, (rank, i))) is None:
                    graph.add_edge(source, (rank, i), kind=kind, order=False, needs=(need,), transfers=moved)
                else:
                    edge.update(kind=max(edge["kind"], kind, key=_STRENGTH.index), needs=(*edge["needs"], need),
                                transfers=(*edge["transfers"], *moved))
    return graph


_STRENGTH = ("order", "stage", "local", "transfer")
"""An edge that is several of these is the last (what it draws as)."""
