"""``zb-auto``: the fastest schedule it can find for a cost model and a memory limit.

It searches every placement the shape allows — interleaved with one and with two chunks per rank, and
the V — unless the caller pins the vpp or the placement, and in each:

1. every fixed algorithm registered for that placement (1F1B, ZB-H1/H2, interleaved 1F1B, ZBV, V-half,
   V-min, DualPipe-V, plug-ins...) whose table fits the memory limit;
2. constructions at the memory limit itself: the greedy list scheduler over a grid of warm-up caps
   (the zero-bubble papers' heuristic), and on the V the V-shape family's constructions (building
   blocks, the hand-crafted ZBV order, greedy fills) at the limit's budget;
3. where the order MILP (:mod:`primuspipe.search.zb_milp`) is small enough, HiGHS improves on the best
   table of its placement, seeded with it, and proves a lower bound.

With ``offload=True`` (``simulate --offload``) a fixed algorithm's table over the memory limit is not
dropped: the offload pass (:mod:`primuspipe.passes.offload`) plans its OFFLOAD/RELOAD nodes at the limit,
as it would for that algorithm outside the search, and the table is a candidate if the pass gets it
under. So every table a caller could get from a fixed algorithm and the pass competes on the same
footing as the constructions, and zb-auto is never slower than the best of them. The constructions and
the MILP stay within the limit without copies (the MILP has no OFFLOAD nodes to order, so it is seeded
with the best table that needs none).

Every candidate is timed by the simulator under the request's cost model (compute per stage, P2P, what
W keeps of the activations), and memory is counted as the device holds it (each microbatch from its
F until its W). The search is bounded by work — the number of fills per placement, the MILP's node and
iteration limits — never by the clock, so the same request gives the same table on every machine and
under any load; a real run can still check that every rank holds the same table
(:mod:`primuspipe.runtime.driver`). How the answer was found is a separate value, the
:class:`ZbAutoReport` that :func:`zb_auto_search` returns; the table's name stays ``zb-auto``.
Progress goes to ``logging`` (``primuspipe.search.zb_auto``) and to an optional callback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from primuspipe.algorithms.build import compute_table
from primuspipe.algorithms.competition import Filled, fill_all, shortlist
from primuspipe.algorithms.list_scheduler import FillPolicy
from primuspipe.algorithms.registry import ScheduleRequest, list_algorithms, register
from primuspipe.algorithms.vshape import fill_policies, vshape_candidates, zbv_handcrafted
from primuspipe.errors import ConfigError, ScheduleShapeError
from primuspipe.ir.activations import peak_in_flight
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.offload import OffloadError, offload_activations
from primuspipe.passes.validation import validate
from primuspipe.search.zb_milp import count_binaries, solve_order_milp, table_starts
from primuspipe.simulator import SimulationResult, simulate

logger = logging.getLogger(__name__)

MILP_MAX_BINARIES = 800
"""Above this many order binaries HiGHS rarely improves on the heuristics within its work limits."""

FILLS_PER_PLACEMENT = 48
"""Default work bound: constructions filled per placement (greedy-fill policies, most warm-up first, on
the interleaved layouts; the V-shape family's constructions on the V)."""

MILP_NODES = 200
"""Default work bound: branch-and-bound nodes the MILP may explore."""

MILP_ITERATIONS = 50_000
"""Default work bound: simplex iterations the MILP may spend."""

Progress = Callable[[str, float], None]
"""Called with a status line and the fraction of the search done (placements searched so far)."""


@dataclass(frozen=True)
class ZbAutoReport:
    """How :func:`zb_auto_search` found its table (the same for the same request, everywhere)."""

    method: str
    """``"fixed"``, ``"heuristic"`` or ``"milp"``: what produced the returned table."""
    source: str
    """The candidate: an algorithm name, a construction or list-scheduler policy, or the MILP."""
    placement: str
    """The returned table's placement (``"interleaved"`` or ``"v"``)."""
    vpp: int
    step_time: float
    """Simulated step time of the returned table."""
    peak_in_flight: float
    """Its largest per-rank memory peak (1F1B-stage microbatches, counted until W)."""
    lower_bound: float | None
    """A proven lower bound on the step time of any table of that placement (from the MILP), if it ran."""
    optimal: bool
    candidates: int
    """Candidate tables simulated."""
    searched: tuple[str, ...]
    """The placements searched, e.g. ``("interleaved vpp=1", "interleaved vpp=2", "v")``."""

    @property
    def gap(self) -> float | None:
        """Relative optimality gap ``(step - bound) / step``, when a bound is known."""
        if self.lower_bound is None or self.step_time <= 0:
            return None
        return max(self.step_time - self.lower_bound, 0.0) / self.step_time

    @property
    def summary(self) -> str:
        gap = "gap unknown" if self.gap is None else ("optimal" if self.optimal else f"gap {self.gap:.1%}")
        return (f"{self.method}: {self.source} ({_name(self.placement, self.vpp)}), step {self.step_time:g}, "
                f"peak {self.peak_in_flight:.4g}, {gap}; searched {', '.join(self.searched)}")


@dataclass(frozen=True)
class _Best:
    """The best candidate so far; compared by (step time, memory peak), the earlier of equals kept."""

    step_time: float
    peak: float
    method: str
    source: str
    table: ScheduleTable
    result: SimulationResult


def _name(placement: str, vpp: int) -> str:
    return "v" if placement == "v" else f"interleaved vpp={vpp}"


def placements(req: ScheduleRequest, pinned: str | None) -> list[Placement]:
    """The layouts to search: interleaved with vpp 1 and 2 and the V, or those the request's vpp or
    the ``pinned`` placement name allow."""
    if pinned not in (None, "interleaved", "v"):
        raise ConfigError(f"zb-auto: placement must be 'interleaved' or 'v', got {pinned!r}")
    p = req.pp
    vpps = [req.vpp] if req.vpp is not None else [1, 2]
    found = []
    if pinned in (None, "interleaved"):
        found += [Placement.interleaved(p, v) for v in vpps]
    if pinned in (None, "v") and 2 in vpps:
        found.append(Placement.vshape(p))
    if not found:
        raise ScheduleShapeError(f"zb-auto: the V placement needs vpp = 2, got vpp = {req.vpp}")
    return list(dict.fromkeys(found))  # at pp = 1 the V and the interleaved layout coincide


def grid(placement: Placement, microbatches: int, cap: float | None, size: int) -> list[FillPolicy]:
    """The first ``size`` greedy-fill policies, most warm-up first: per-rank caps on forwards in flight
    ``top - slope * rank`` (slope 0, 1, 2: ZB-H2 warms rank r up with 2(p - r) - 1), within the memory
    cap (chunk activations counted until W; None: unbounded)."""
    p, v = placement.pp, placement.vpp
    memory = (float("inf") if cap is None else cap,) * p
    highest = min(2 * placement.num_stages, microbatches * v, int(cap + 1e-9) if cap is not None else 2 * placement.num_stages)
    found = []
    for top in range(highest, 0, -1):
        for slope in (0, 1, 2):
            caps = tuple(max(top - slope * r, 1) for r in range(p))
            if slope and len(set(caps)) == 1:
                continue  # the caps of slope 0
            for reserve in (0,) if v == 1 else (0, 1, 2):
                if reserve < min(caps):
                    found += [FillPolicy(caps, memory, reserve, first) for first in (True, False)]
    return found[:size]


def zb_auto_search(
    req: ScheduleRequest,
    *,
    placement: str | None = None,
    fills: int = FILLS_PER_PLACEMENT,
    include_fixed: bool = True,
    use_milp: bool = True,
    milp_nodes: int = MILP_NODES,
    milp_iterations: int = MILP_ITERATIONS,
    offload: bool = False,
    progress: Progress | None = None,
    check: bool = True,
) -> tuple[ScheduleTable, ZbAutoReport]:
    """Search as described in the module doc; returns the best table and how it was found.

    ``placement`` pins "interleaved" or "v"; ``req.vpp`` pins the vpp (None: search 1 and 2).
    ``fills`` (constructions filled per placement), ``milp_nodes`` and ``milp_iterations`` bound the
    work (see the module doc); ``include_fixed=False`` leaves out the registered algorithms' tables;
    ``offload=True`` lets a fixed table over ``req.memory_limit`` compete with the offload pass's nodes (the
    module doc; the copies are planned and timed with the request's cost model and its ``host_link``).
    ``check=False`` skips validating the answer (for callers such as ``build_schedule`` that validate).

    >>> from primuspipe.ir.cost_model import CostModel
    >>> req = ScheduleRequest(2, 1, 4, CostModel.per_stage(2, 1, 1, 1), memory_limit=2)
    >>> table, report = zb_auto_search(req)
    >>> report.step_time, report.optimal, table.algorithm
    (13.0, True, 'zb-auto')
    """
    if fills < 0 or milp_nodes < 0 or milp_iterations < 0:
        raise ConfigError(f"zb-auto: fills, milp_nodes and milp_iterations must be >= 0, got {fills}, {milp_nodes}, "
                          f"{milp_iterations}")
    if offload and req.memory_limit is None:
        raise ConfigError("zb-auto: offload brings tables under the memory limit; give memory_limit (1F1B-stage "
                          "microbatches)")
    layouts = placements(req, placement)
    best: _Best | None = None
    tried = 0
    by_layout: dict[Placement, _Best] = {}  # tables without copies: what the MILP may be seeded with
    offloaded: list[_Best] = []

    def report(line: str, done: float, level: int = logging.INFO) -> None:
        logger.log(level, "zb-auto: %s", line)
        if progress is not None:
            progress(line, done)

    def consider(method: str, source: str, table: ScheduleTable, layout: Placement, may_offload: bool = False) -> None:
        nonlocal best, tried
        copies = False
        if may_offload and not req.fits(table):
            try:
                table = offload_activations(table, req.cost_model(table.vpp), memory_limit=req.memory_limit)
            except OffloadError:
                return
            source, copies = f"{source} + offload pass", True
        if not req.fits(table):
            return
        cost = req.cost_model(table.vpp)
        peak = max(peak_in_flight(table, req.retained, cost.memory.offload_fraction))
        tried += 1
        result = simulate(table, cost)
        candidate = _Best(result.step_time, peak, method, source, table, result)
        if copies:
            offloaded.append(candidate)
        elif layout not in by_layout or (candidate.step_time, peak) < (by_layout[layout].step_time, by_layout[layout].peak):
            by_layout[layout] = candidate
        if best is None or (candidate.step_time, peak) < (best.step_time, best.peak):
            best = candidate
            report(f"best so far {result.step_time:g} from {source} ({_name(layout.name, layout.vpp)}, peak {peak:.4g})",
                   layouts.index(layout) / len(layouts), logging.DEBUG)

    for i, layout in enumerate(layouts):
        report(f"searching {_name(layout.name, layout.vpp)}", i / len(layouts))
        sub = replace(req, vpp=layout.vpp, cost=req.cost_model(layout.vpp))
        for name, table in _fixed_candidates(sub, layout) if include_fixed else ():
            consider("fixed", name, table, layout, offload)
        for candidate in _constructions(sub, layout, fills):
            consider("heuristic", candidate.source, candidate.table, layout)
    if best is None:
        raise ScheduleShapeError(
            f"zb-auto: no schedule of pp={req.pp}, {req.microbatches} microbatches "
            f"({', '.join(_name(lay.name, lay.vpp) for lay in layouts)}) fits {_limits(req)}; raise the memory limit"
        )
    lower_bound, optimal = None, False
    if by_layout:
        seed = min(by_layout.values(), key=lambda c: (c.step_time, c.peak))
        lower_bound, optimal = _improve_with_milp(req, seed.table.placement, by_layout, consider, report, use_milp,
                                                  milp_nodes, milp_iterations)
    plain = min(by_layout.values(), key=lambda c: (c.step_time, c.peak), default=None)
    best = min(offloaded, key=lambda c: (c.step_time, c.peak), default=None)
    if best is None or (plain is not None and plain.step_time <= best.step_time):
        best = plain  # copies only where they buy step time: they load the host link the simulator prices alone
    else:
        lower_bound = None  # the MILP bounds tables without copies: no bound on this one
    optimal = optimal and best.step_time <= (lower_bound or 0.0) + 1e-6
    final = ZbAutoReport(best.method, best.source, best.table.placement.name, best.table.vpp, best.step_time, best.peak,
                         lower_bound, optimal, tried, tuple(_name(lay.name, lay.vpp) for lay in layouts))
    report(final.summary, 1.0)
    table = replace(best.table, algorithm="zb-auto")
    if check:
        validate(add_communication(table))
    return table, final


def _limits(req: ScheduleRequest) -> str:
    """The request's memory limits, in words."""
    said = []
    if req.memory_limit is not None:
        said.append(f"{req.memory_limit:g} microbatches of activations per rank (counted until W)")
    if req.memory_limit_bytes is not None:
        said.append(f"{min(req.memory_limit_bytes) / 1e9:.4g} GB of activations on the tightest rank (the "
                    "simulator's byte count: a B's rise and what W keeps included)")
    return " and ".join(said)


def _fixed_candidates(req: ScheduleRequest, layout: Placement) -> Iterator[tuple[str, ScheduleTable]]:
    """The registered algorithms' tables on this layout (each built with the request's cost model)."""
    for info in list_algorithms():
        if info.placement == "any" or info.vpp not in (None, layout.vpp):
            continue
        try:
            table = compute_table(info, req)
        except ScheduleShapeError:
            continue
        if table.placement == layout:
            yield info.name, table


def _constructions(req: ScheduleRequest, layout: Placement, fills: int) -> list[Filled]:
    """Tables built at the memory limit itself that fit it. Constructions count chunk activations (the
    retained share until W); a byte limit allows a range of such caps (:meth:`ScheduleRequest.chunk_cap`):
    within the sure one every table fits, above the loose one none does. Between them a bisection on one
    probe per cap -- the greediest fill, which holds the most -- finds the largest cap where it still fits by
    the byte count; the constructions are built there (and at the sure cap where none of them fits)."""
    sure, loose = (None if cap is None else int(cap + 1e-9) for cap in req.chunk_cap(layout))
    if sure is None or loose is None or sure >= loose:
        return _constructions_at(req, layout, fills, loose)
    while loose - sure > 1:
        mid = (sure + loose) // 2
        sure, loose = (mid, loose) if _probe_fits(req, layout, mid) else (sure, mid)
    top = loose if _probe_fits(req, layout, loose) else sure
    return _constructions_at(req, layout, fills, top) or _constructions_at(req, layout, fills, sure)


def _probe_fits(req: ScheduleRequest, layout: Placement, cap: int) -> bool:
    """Whether the greediest fill within ``cap`` chunk activations (the first V-shape fill policy, or the
    most warm-up of the grid) fits the request's limits; a fill that stalls does not."""
    policies = fill_policies(req.pp, cap) if layout.name == "v" else grid(layout, req.microbatches, cap, 1)
    filled = fill_all(layout, req.microbatches, req.cost_model(layout.vpp), policies[:1], algorithm="zb-auto")
    return bool(filled) and req.fits(filled[0].table)


def _constructions_at(req: ScheduleRequest, layout: Placement, fills: int, cap: float | None) -> list[Filled]:
    """Tables built within ``cap`` chunk activations per rank that fit the request's limits: the shortlist of
    the greedy fills (and, on the V, of the V-shape family's constructions), plus ready-made tables such as
    the hand-crafted ZBV."""
    if layout.name == "v" and layout.vpp == 2:
        chunks = 2 * req.pp if cap is None else int(cap + 1e-9)
        if chunks < 1:
            return []
        policies, ready = vshape_candidates(req, chunks, (zbv_handcrafted(req.pp, req.microbatches),))
    else:
        policies, ready = grid(layout, req.microbatches, cap, fills), []
    filled = fill_all(layout, req.microbatches, req.cost_model(layout.vpp), policies[:fills], algorithm="zb-auto")
    return [*shortlist([f for f in filled if req.fits(f.table)]), *(f for f in ready if req.fits(f.table))]


def _improve_with_milp(req: ScheduleRequest, layout: Placement, by_layout: dict, consider, report, use_milp: bool,
                       nodes: int, iterations: int) -> tuple[float | None, bool]:
    """Run the order MILP on the best table's layout when it is small enough; returns (bound, optimal)."""
    if not use_milp or (size := count_binaries(layout, req.microbatches, MILP_MAX_BINARIES)) is None:
        return None, False
    seed = by_layout[layout]
    incumbent = table_starts(seed.result.table, [r.starts for r in seed.result.ranks])
    cost = req.cost_model(layout.vpp)
    cap = req.chunk_cap(layout)[1]  # no fitting table holds more: the bound stays a bound
    report(f"MILP over {size} order binaries ({_name(layout.name, layout.vpp)}), at most {nodes} nodes", 0.9)
    milp = solve_order_milp(layout, req.microbatches, cost, cap=cap, upper_bound=seed.step_time, node_limit=nodes,
                            iteration_limit=iterations, incumbent=incumbent)
    if milp.rows is not None:
        consider("milp", "order MILP (HiGHS)", ScheduleTable.build(layout, req.microbatches, milp.rows, "zb-auto"), layout)
    report(f"MILP bound {milp.lower_bound:g}, {'optimal' if milp.optimal else 'not proven optimal'}", 0.95)
    return milp.lower_bound, milp.optimal


@register("zb-auto", placement="any", split_backward=True)
def zb_auto(
    req: ScheduleRequest, *, placement: str | None = None, fills: int = FILLS_PER_PLACEMENT, include_fixed: bool = True,
    use_milp: bool = True, milp_nodes: int = MILP_NODES, milp_iterations: int = MILP_ITERATIONS, offload: bool = False,
) -> ScheduleTable:
    """zb-auto: searches every placement (fixed algorithms, constructions at the memory limit, order MILP) for the fastest schedule under the cost model and memory limit.

    Its compute order at pp=4, m=4 (F = B = W per 1F1B stage, no memory limit: interleaved with two
    chunks, proven optimal; notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 f0 f1 f2 f3 b0 w0 b1 w1 b2 B0 B1 w2 b3 B2 W0 W1 B3 w3 W2 W3
        rank 1 | F0 F1 F2 F3 f0 f1 f2 f3 b0 w0 b1 w1 b2 B0 B1 w2 b3 B2 W0 W1 B3 w3 W2 W3
        rank 2 | F0 F1 F2 F3 f0 f1 f2 b0 f3 b1 w0 b2 B0 B1 w1 b3 B2 w2 W0 B3 W1 w3 W2 W3
        rank 3 | F0 F1 F2 F3 f0 b0 f1 b1 f2 b2 B0 B1 f3 b3 B2 w0 w1 B3 w2 W0 W1 w3 W2 W3
    """
    return zb_auto_search(req, placement=placement, fills=fills, include_fixed=include_fixed, use_milp=use_milp,
                          milp_nodes=milp_nodes, milp_iterations=milp_iterations, offload=offload, check=False)[0]
