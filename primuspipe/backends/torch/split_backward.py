"""A stage's backward split on its autograd graph: ``B`` (input gradients), then ``W`` (weight gradients),
with no gradient computed twice.

A ``BW`` node is one ``torch.autograd.backward``. A split backward must give the same gradients with the
same GEMMs: ``B`` computes only what the previous stage waits for (the gradients of the stage inputs),
``W`` only the parameter gradients, and together they do exactly the work of ``BW``.

``B`` runs ``torch.autograd.grad`` from the stage outputs to its inputs. Autograd runs each graph node
only for the edges that lead to the requested inputs, so a linear layer's ``addmm`` computes
``dX = dY W`` and skips ``dW = dYᵀ X``. Before it runs, :func:`backward_input` finds the *frontier*:
the nodes ``B`` will run that also have edges towards parameters which ``B`` will not follow, and hooks
them to record the gradient flowing into them. ``W`` (:meth:`DeferredWeightGrad.run`) restarts
autograd at those nodes with the recorded gradients and the parameters as its only targets, so each
runs again for its parameter edges alone (the ``dW`` GEMM), and the parameter-only subgraphs below it
(a bias reduction, LayerNorm's affine gradient, a weight's transpose) run once.

* Parameters accumulate through autograd's own accumulators, so ``.grad`` and every hook on it (DDP's
  reducer, ``register_post_accumulate_grad_hook``) behave exactly as after a fused backward.
* Frontier nodes whose parameter subgraphs meet (a parameter used at two places in one stage) restart
  in one call, their recorded gradients pinned by a pre-hook so a path between them is not counted
  twice; only then does ``W`` redo the input-gradient math between those two places.
* A stage whose inputs need no gradient (the first stage) has no input gradient to compute: its ``B``
  does nothing and its ``W`` is the whole backward (as in torch.distributed.pipelining).
* Memory: autograd frees saved tensors per graph, not per edge, so a microbatch's activations stay
  alive from its ``B`` until its ``W`` (in the cost model's terms, ``w_retained_fraction`` = 1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Restart:
    """One autograd call of a ``W``: where it starts, with which gradients, and what it accumulates."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    pinned: list[tuple[Node, tuple]] = field(default_factory=list)
    """Frontier nodes whose incoming gradient is held at its recorded value during the call."""


class DeferredWeightGrad:
    """What a ``B`` left for its ``W``: the autograd restarts that accumulate the parameter gradients."""

    def __init__(self, restarts: list[_Restart]):
        self._restarts = restarts

    def run(self) -> None:
        """Accumulate the parameter gradients (once; the graph is released afterwards)."""
        restarts, self._restarts = self._restarts, []
        for restart in restarts:
            handles = [node.register_prehook(lambda _, grads=grads: grads) for node, grads in restart.pinned]
            try:
                # retain_graph: a pinned restart may run input-gradient nodes another restart also needs;
                # the graph goes when this object drops its references.
                torch.autograd.backward(restart.edges, restart.grads, inputs=restart.targets, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor | None, ...], DeferredWeightGrad]:
    """``B``: the gradients of ``inputs`` (None where an input does not affect the outputs), and the
    weight-gradient work for the matching ``W``.

    ``outputs`` are the stage outputs that require grad, ``output_grads`` their gradients (None for a
    scalar loss), ``inputs`` the stage inputs that require grad (leaves)."""
    graph = _Graph(outputs, inputs)
    recorded: dict[Node, tuple] = {}
    handles = [node.register_prehook(lambda grads, node=node: recorded.__setitem__(node, tuple(grads)))
               for node in graph.frontier]
    try:
        if graph.input_side:
            grads = torch.autograd.grad(outputs, inputs, output_grads, retain_graph=True, allow_unused=True)
        else:
            grads = tuple(None for _ in inputs)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(grads), DeferredWeightGrad(graph.restarts(recorded, outputs, output_grads))


class _Graph:
    """The autograd graph of one stage and microbatch, split at its frontier (module docstring)."""

    def __init__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]):
        self.root_edges = [get_gradient_edge(t) for t in outputs]
        input_nodes = {get_gradient_edge(t).node for t in inputs}
        self.children: dict[Node, list[Node]] = {}
        pending = deque(edge.node for edge in self.root_edges)
        while pending:
            node = pending.popleft()
            if node in self.children:
                continue
            self.children[node] = [child for child, _ in node.next_functions if child is not None]
            pending.extend(self.children[node])
        self.parents: dict[Node, list[Node]] = {}
        for node, children in self.children.items():
            for child in children:
                self.parents.setdefault(child, []).append(node)
        leaves = {n for n in self.children if hasattr(n, "variable") and n not in input_nodes}
        self.input_side = self._reaching(input_nodes)
        """Nodes ``B`` runs: those with a path to an input."""
        self.weight_side = self._reaching(leaves) - self.input_side
        """Nodes only ``W`` runs: a path to a parameter, none to an input."""
        self.frontier = [n for n in self.children if n in self.input_side
                         and any(c in self.weight_side for c in self.children[n])]

    def _reaching(self, targets: set[Node]) -> set[Node]:
        """Nodes with a path to one of ``targets`` (included)."""
        found, pending = set(targets), deque(targets)
        while pending:
            for parent in self.parents.get(pending.popleft(), ()):
                if parent not in found:
                    found.add(parent)
                    pending.append(parent)
        return found & set(self.children)

    def restarts(self, recorded: dict[Node, tuple], outputs: Sequence[torch.Tensor],
                 output_grads: Sequence[torch.Tensor | None]) -> list[_Restart]:
        """One restart per group of start points whose weight-only subgraphs meet."""
        starts: list[_Start] = []
        for node in self.frontier:
            grads = recorded.get(node, ())
            if any(g is not None for g in grads):
                starts.append(_Start([GradientEdge(node, i) for i, g in enumerate(grads) if g is not None],
                                     [g for g in grads if g is not None], node,
                                     [c for c in self.children[node] if c in self.weight_side]))
        for edge, out, grad in zip(self.root_edges, outputs, output_grads):
            if edge.node in self.weight_side:  # an output no input affects: W starts there
                starts.append(_Start([edge], [torch.ones_like(out) if grad is None else grad], None, [edge.node]))
        group = list(range(len(starts)))

        def find(i: int) -> int:
            while group[i] != i:
                group[i] = i = group[group[i]]
            return i

        owner: dict[Node, int] = {}
        for i, start in enumerate(starts):
            for node in self._weight_closure(start.below):
                if node in owner:
                    group[find(i)] = find(owner[node])
                else:
                    owner[node] = i
        merged: dict[int, _Restart] = {}
        for i, start in enumerate(starts):
            restart = merged.setdefault(find(i), _Restart())
            restart.edges += start.edges
            restart.grads += start.grads
            if start.node is not None:
                restart.pinned.append((start.node, recorded[start.node]))
        for node, i in owner.items():
            if hasattr(node, "variable"):
                merged[find(i)].targets.append(node.variable)
        for restart in merged.values():
            if len(restart.pinned) == 1:
                restart.pinned = []  # one frontier node: nothing else can add to its gradient
        return [r for r in merged.values() if r.targets]

    def _weight_closure(self, nodes: list[Node]) -> set[Node]:
        """Weight-side nodes reachable from ``nodes`` (included)."""
        found, pending = set(), deque(nodes)
        while pending:
            node = pending.popleft()
            if node in found or node not in self.weight_side:
                continue
            found.add(node)
            pending.extend(self.children[node])
        return found


@dataclass
class _Start:
    """Where a ``W`` may restart autograd: a frontier node (or an output only parameters affect)."""

    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    node: Node | None
    """The frontier node (None for an output's own node)."""
    below: list[Node]
    """Its weight-side children (or the output's node): where its weight-only subgraph begins."""
