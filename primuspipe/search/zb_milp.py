"""The exact search behind ``zb-auto``: a mixed-integer program over node orders, solved with HiGHS.

Formulation (the Zero Bubble paper's, made smaller):

* a start time ``t[x]`` per node ``x = (kind, stage, microbatch)``, the makespan ``C >= t[x] + d[x]``;
* dependencies: ``t[x] >= t[y] + d[y] (+ P2P if y runs on another rank)`` for every producer ``y``;
* one binary ``o[a, b]`` per pair of nodes on one rank whose order is *not already implied*: the pair
  runs one way or the other (big-M with M = the incumbent's makespan);
* memory: right after each forward, the rank's held activations (the effects of the forwards, B's and
  W's before it: each microbatch held from its F until its W, the cost model's retained share between
  its B and its W) stay within the cap, written with the same order binaries.

Why it is smaller: the microbatches are interchangeable (per-stage costs do not depend on them), so an
exchange argument shows some optimal schedule runs each (kind, stage) in microbatch order. With that
order fixed, node ``a`` of microbatch ``i`` precedes node ``b`` of microbatch ``j >= i`` whenever ``b``
depends on ``a``'s kind and stage within one microbatch, and such pairs need no binary. The model's
lower bound is therefore a lower bound on every schedule, and its optimum is the true optimum under
the same timing rules (the simulator adds only rendezvous waits, which are zero with no P2P time).

The solver runs bounded by work (branch-and-bound nodes, simplex iterations, one thread), never by the
clock, so its answer is the same on every machine and under any load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.dataflow import Step, reaches, step_needs
from primuspipe.ir.kinds import split_kinds
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable

logger = logging.getLogger(__name__)

Key = Step
"""A node of the model: its kind, stage and microbatch (one node completes one step)."""

_KINDS = split_kinds()
"""The kinds the model orders: a split backward (``F``, ``B``, ``W``)."""


@dataclass(frozen=True)
class MilpResult:
    rows: tuple[tuple[ScheduleNode, ...], ...] | None
    """Best order found (None if the solver found none better than the incumbent it was given)."""
    lower_bound: float
    optimal: bool


def precedes(a: Key, b: Key, num_stages: int) -> bool:
    """``a`` runs before ``b`` in every microbatch-ordered schedule: ``b`` depends on ``a``'s kind and
    stage within one microbatch (the dependency model's transitive closure) and ``a``'s microbatch is
    not later."""
    if a == b or a.microbatch > b.microbatch:
        return False
    return (Step(a.kind, a.stage, 0), Step(b.kind, b.stage, 0)) in reaches(num_stages)


def count_binaries(placement: Placement, microbatches: int, limit: int) -> int | None:
    """How many order binaries the model needs, or None if clearly more than ``limit`` (to decide up
    front, cheaply, whether the MILP can be tried)."""
    per_rank = 3 * microbatches * placement.vpp
    if placement.pp * per_rank * per_rank // 8 > limit:  # at least a quarter of all pairs are free
        return None
    count = sum(len(_free_pairs(_rank_nodes(placement, microbatches, r), placement.num_stages)) for r in range(placement.pp))
    return count if count <= limit else None


def _producers(placement: Placement, key: Key) -> list[Key]:
    """The steps ``key`` waits for (dataflow's rules)."""
    return step_needs(placement, key.kind, key.stage, key.microbatch)


def _rank_nodes(placement: Placement, m: int, rank: int) -> list[Key]:
    return [Step(k, placement.stage(rank, c), i) for c in range(placement.vpp) for k in _KINDS for i in range(m)]


def _free_pairs(nodes: list[Key], num_stages: int) -> list[tuple[Key, Key]]:
    return [(a, b) for x, a in enumerate(nodes) for b in nodes[x + 1:]
            if not precedes(a, b, num_stages) and not precedes(b, a, num_stages)]


def solve_order_milp(
    placement: Placement,
    microbatches: int,
    cost: CostModel,
    *,
    cap: float | None,
    upper_bound: float,
    node_limit: int,
    iteration_limit: int,
    incumbent: dict[Key, float] | None = None,
) -> MilpResult:
    """Minimise the makespan; ``cap`` bounds each rank's held activations (chunk units, each counted
    until its W with the cost model's retained share), ``incumbent`` (start time per node, e.g. from
    simulating the heuristic's best table) seeds the search.

    The solver is bounded by work, never by the clock: at most ``node_limit`` branch-and-bound nodes
    and ``iteration_limit`` simplex iterations, on one thread, so the same inputs give the same answer
    on every machine and under any load."""
    import highspy

    m, pp = microbatches, placement.pp
    num_stages = placement.num_stages
    dur = {kind: tuple(cost.duration(kind, s) for s in range(num_stages)) for kind in _KINDS}
    delta = {kind: kind.spec.activation_delta(cost.memory.w_retained_fraction) for kind in _KINDS}
    h = highspy.Highs()
    for option, value in (("output_flag", False), ("threads", 1), ("random_seed", 0), ("time_limit", highspy.kHighsInf),
                          ("mip_max_nodes", node_limit), ("simplex_iteration_limit", iteration_limit)):
        h.setOptionValue(option, value)
    inf = highspy.kHighsInf
    col: dict[object, int] = {}
    integers: list[int] = []

    def add_col(name: object, lo: float, hi: float, cost: float = 0.0, integer: bool = False) -> int:
        idx = h.getNumCol()
        h.addCol(cost, lo, hi, 0, [], [])
        if integer:
            integers.append(idx)
        col[name] = idx
        return idx

    def add_row(lo: float, hi: float, terms: dict[int, float]) -> None:
        h.addRow(lo, hi, len(terms), list(terms), list(terms.values()))

    makespan = add_col("C", 0.0, upper_bound, 1.0)
    rank_nodes = [_rank_nodes(placement, m, r) for r in range(pp)]
    for nodes in rank_nodes:
        for key in nodes:
            add_col(key, 0.0, upper_bound - dur[key[0]][key[1]])
    # dependencies and the makespan
    for r, nodes in enumerate(rank_nodes):
        for kind, s, i in nodes:
            me = col[(kind, s, i)]
            for pk, ps, _ in _producers(placement, Step(kind, s, i)):
                delay = _delay(cost, placement.rank_of(ps), r)
                add_row(dur[pk][ps] + delay, inf, {me: 1.0, col[(pk, ps, i)]: -1.0})
            if i > 0:  # microbatch order within (kind, stage)
                add_row(dur[kind][s], inf, {me: 1.0, col[(kind, s, i - 1)]: -1.0})
            add_row(dur[kind][s], inf, {makespan: 1.0, me: -1.0})
    # one rank runs one node at a time: an order binary per undecided pair
    big_m = upper_bound
    order: dict[tuple[Key, Key], int] = {}
    for nodes in rank_nodes:
        for a, b in _free_pairs(nodes, num_stages):
            y = order[(a, b)] = add_col(("o", a, b), 0.0, 1.0, integer=True)
            ta, tb = col[a], col[b]
            add_row(dur[a[0]][a[1]] - big_m, inf, {tb: 1.0, ta: -1.0, y: -big_m})  # y = 1: a before b
            add_row(dur[b[0]][b[1]], inf, {ta: 1.0, tb: -1.0, y: big_m})  # y = 0: b before a

    h.changeColBounds(makespan, _static_bound(placement, rank_nodes, dur, cost), upper_bound)

    def before(a: Key, b: Key) -> tuple[float, dict[int, float]]:
        """[a runs before b] as constant + linear terms."""
        if precedes(a, b, num_stages):
            return 1.0, {}
        if precedes(b, a, num_stages):
            return 0.0, {}
        if (a, b) in order:
            return 0.0, {order[(a, b)]: 1.0}
        return 1.0, {order[(b, a)]: -1.0}

    if cap is not None:
        for nodes in rank_nodes:
            # held right after forward a: one chunk activation per part before it, by the kind's effect
            forwards = [x for x in nodes if x.kind is NodeKind.F]
            for a in forwards:
                const, terms = delta[a.kind], {}
                for other in nodes:
                    sign = delta[other.kind]
                    if other == a or not sign:
                        continue
                    c, t = before(other, a)
                    const += sign * c
                    for idx, v in t.items():
                        terms[idx] = terms.get(idx, 0.0) + sign * v
                if terms:
                    add_row(-inf, cap - const, terms)
                else:
                    assert const <= cap + 1e-9
    h.changeColsIntegrality(len(integers), integers, [highspy.HighsVarType.kInteger] * len(integers))
    logger.info("zb-auto MILP: %d columns (%d order binaries), %d rows, at most %d nodes",
                h.getNumCol(), len(order), h.getNumRow(), node_limit)
    if incumbent is not None:
        values = [0.0] * h.getNumCol()
        values[makespan] = max(incumbent[k] + dur[k[0]][k[1]] for k in incumbent)
        for key, start in incumbent.items():
            values[col[key]] = start
        for (a, b), idx in order.items():
            values[idx] = 1.0 if incumbent[a] < incumbent[b] or (incumbent[a] == incumbent[b] and dur[a[0]][a[1]] == 0) else 0.0
        sol = highspy.HighsSolution()
        sol.col_value = values
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    bound = max(float(info.mip_dual_bound), 0.0)
    if info.primal_solution_status == 0:  # no feasible point
        return MilpResult(None, bound, False)
    values = h.getSolution().col_value
    objective = float(info.objective_function_value)
    optimal = status == highspy.HighsModelStatus.kOptimal
    if optimal:
        bound = objective
    rows = []
    for nodes in rank_nodes:
        timed = sorted(nodes, key=lambda x: (values[col[x]], sum(precedes(y, x, num_stages) for y in nodes)))
        rows.append(tuple(ScheduleNode(k, i, placement.locate(s)[1]) for k, s, i in timed))
    return MilpResult(tuple(rows), bound, optimal)


def _static_bound(placement: Placement, rank_nodes: list[list[Key]], dur: dict, cost: CostModel) -> float:
    """A makespan no order can beat: per rank, the earliest any of its nodes can start plus its whole
    work, and for each node its earliest end plus the work on its rank that must follow it."""
    earliest: dict[Key, float] = {}

    def start(key: Key) -> float:
        if key not in earliest:
            rank = placement.rank_of(key[1])
            earliest[key] = max((start(p) + dur[p[0]][p[1]] + _delay(cost, placement.rank_of(p[1]), rank)
                                 for p in _producers(placement, key)), default=0.0)
        return earliest[key]

    for nodes in rank_nodes:
        for x in nodes:
            start(x)
    bound = 0.0
    for nodes in rank_nodes:
        work = {x: dur[x[0]][x[1]] for x in nodes}
        bound = max(bound, min(earliest[x] for x in nodes) + sum(work.values()))
        for x in nodes:
            bound = max(bound, earliest[x] + work[x] + sum(work[y] for y in nodes if precedes(x, y, placement.num_stages)))
    return bound


def _delay(cost: CostModel, src: int, dst: int) -> float:
    return cost.p2p.transfer_time(src, dst) if src != dst else 0.0


def table_starts(table: ScheduleTable, starts_by_rank: list[list[float]]) -> dict[Key, float] | None:
    """Start time per node of a split-backward, microbatch-ordered table (for seeding), else None."""
    out: dict[Key, float] = {}
    for rank, row in enumerate(table.ranks):
        compute = [(n, s) for n, s in zip(row, starts_by_rank[rank]) if n.kind.is_compute]
        for node, start in compute:
            if node.kind not in _KINDS:
                return None
            out[Step(node.kind, table.placement.stage(rank, node.chunk), node.microbatch)] = start
    for rank_nodes in _by_kind_stage(out).values():
        if [i for _, i in sorted(rank_nodes)] != sorted(i for _, i in rank_nodes):
            return None
    return out


def _by_kind_stage(starts: dict[Key, float]) -> dict[tuple[str, int], list[tuple[float, int]]]:
    groups: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for (k, s, i), t in starts.items():
        groups.setdefault((k, s), []).append((t, i))
    return groups
