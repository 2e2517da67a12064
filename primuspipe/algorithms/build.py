"""The one call that turns an algorithm name and a shape into a validated, runnable table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from primuspipe.algorithms import ScheduleRequest, get_algorithm, list_algorithms
from primuspipe.algorithms.registry import BUILTIN_MODULES, AlgorithmInfo
from primuspipe.errors import AlgorithmOutputError, ConfigError, PrimusPipeError, ScheduleShapeError, ValidationError
from primuspipe import strict
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.limits import check_shape
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import check_structure, validate

REMOVED_OPTIONS = {
    "p2p_time": "algorithms take P2P time from the cost model: pass cost=CostModel(..., p2p=P2PCost(...)) "
                "(CLI: --p2p X or the cost file's p2p section)",
    "costs": "pass the cost model itself: cost=CostModel(...) (CostModel(compute_costs) wraps per-stage times)",
}
"""Keyword arguments that once existed, and what replaced them."""


def check_options(algorithm: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked for ``algorithm``: a removed one is named with what replaced it, then names and
    value types (:meth:`~primuspipe.algorithms.registry.AlgorithmInfo.check_options`). Raises :class:`ConfigError`."""
    if removed := set(options) & set(REMOVED_OPTIONS):
        name = sorted(removed)[0]
        raise ConfigError(f"{algorithm}: option {name!r} is gone; {REMOVED_OPTIONS[name]}")
    return get_algorithm(algorithm).check_options(options)


def offload_options(algorithm: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """How a caller that brings tables under a memory limit with the offload pass -- ``primuspipe simulate
    --offload``, the Megatron backend's ``offload: true`` -- builds ``algorithm``: ``(options, run_pass)``.

    An algorithm that weighs the pass's copies itself (it takes an ``offload`` option: zb-auto, whose search
    then lets the fixed tables the pass brings under the limit compete with its own constructions, so it is
    never behind one of them) gets ``offload=True`` and needs the memory limit; its table is taken as it is
    (``run_pass`` False). Any other is built as asked, then goes through the pass (``run_pass`` True).

    >>> offload_options("zb-auto", {"fills": 2})
    ({'offload': True, 'fills': 2}, False)
    >>> offload_options("v-half", {})
    ({}, True)
    """
    if any(p.name == "offload" for p in get_algorithm(algorithm).options()):
        return {"offload": True, **options}, False
    return dict(options), True


@strict.arguments()
def build_schedule(
    algorithm: str,
    pp: int,
    microbatches: int,
    vpp: int | None = None,
    *,
    cost: CostModel | None = None,
    memory_limit: float | None = None,
    memory_limit_bytes: float | tuple[float, ...] | None = None,
    communication: bool = True,
    **options: Any,
) -> ScheduleTable:
    """Build ``algorithm``'s table for the shape, add communication and validate it.

    ``vpp`` defaults to what the algorithm requires, else its default (1, or 2 for interleaved-1f1b);
    an algorithm that chooses its placement (``zb-auto``) picks it unless ``vpp`` is given, and the
    table says which. ``cost`` is the cost model the table will be judged by (the simulator's);
    cost-aware algorithms plan with it, and with ``memory_limit`` (1F1B-stage microbatches per rank,
    counted until W with the model's retained share) and ``memory_limit_bytes`` (activation bytes per rank,
    one number or one per rank, as the simulator's byte peak counts them). Raises
    :class:`ScheduleShapeError` when the algorithm refuses the shape or it is too large to build
    (:func:`~primuspipe.ir.table.check_shape`), :class:`ConfigError` for unknown options or values of the wrong type,
    and :class:`AlgorithmOutputError` when the algorithm returns no compute-only table of the shape.

    >>> t = build_schedule("1f1b", pp=2, microbatches=3)
    >>> [str(n) for n in t.ranks[1]][:6]
    ['RECV_F0.0<0', 'F0.0', 'RECV_F1.0<0', 'BW0.0', 'SEND_B0.0>0', 'F1.0']
    """
    info = get_algorithm(algorithm)
    pp, microbatches = (strict.count(v, f"{algorithm}: {name}", minimum=1, error=ScheduleShapeError)
                        for name, v in (("pp", pp), ("microbatches", microbatches)))  # numpy integers too
    vpp = info.resolve_vpp(None if vpp is None else strict.count(vpp, f"{algorithm}: vpp", minimum=1,
                                                                error=ScheduleShapeError))
    if info.vpp is not None and vpp != info.vpp:
        takes = [i.name for i in list_algorithms() if i.vpp in (None, vpp)]
        raise ScheduleShapeError(f"{algorithm} needs vpp = {info.vpp}, got vpp = {vpp}: give vpp {info.vpp} (or "
                                 f"none), or an algorithm that runs vpp {vpp}: "
                                 f"{', '.join(takes) or 'none is registered'}")
    check_shape(pp, vpp or 2, microbatches)  # an algorithm that picks its placement may pick vpp 2
    options = check_options(algorithm, options)
    if memory_limit is not None:
        memory_limit = strict.number(memory_limit, "memory_limit", above=0)
    if cost is not None:
        strict.instance(cost, CostModel, "build_schedule's cost")
    if cost is not None and cost.num_stages % pp:
        raise ConfigError(f"the cost model describes {cost.num_stages} stages, which {pp} ranks cannot share")
    if cost is not None and vpp is not None and cost.num_stages not in (pp, pp * vpp):
        raise ConfigError(f"the cost model describes {cost.num_stages} stages but pp*vpp = {pp * vpp}; "
                          "build it for this shape (CostModel.for_shape) or per 1F1B stage")
    request = ScheduleRequest(pp, vpp, microbatches, cost, memory_limit, memory_limit_bytes)
    table = compute_table(info, request, options)
    if communication:
        table = add_communication(table)
    return validate(table)


def compute_table(info: AlgorithmInfo, request: ScheduleRequest, options: Mapping[str, Any] = MappingProxyType({})
                  ) -> ScheduleTable:
    """``info``'s compute-only table for ``request`` -- the one place an algorithm's function is called
    (``build_schedule``, and zb-auto drawing on every registered algorithm): what it returned is checked
    (:func:`_returned_table`), and a plug-in's own failure (any exception but the project's: a KeyError, a
    RecursionError) is an :class:`AlgorithmOutputError` naming it, as a plug-in that fails to load is. A built-in
    algorithm's failure is a bug of primuspipe's and stays the traceback it is."""
    try:
        table = info.build(request, **info.preset, **options)
    except PrimusPipeError:
        raise
    except Exception as exc:
        if info.build.__module__ in BUILTIN_MODULES:
            raise
        raise AlgorithmOutputError(f"{_who(info)} failed: {type(exc).__name__}: {exc}") from exc
    return _returned_table(info, table, request)


def _who(info: AlgorithmInfo) -> str:
    return f"algorithm {info.name!r} ({info.build.__module__})"


def _returned_table(info: AlgorithmInfo, table: object, request: ScheduleRequest) -> ScheduleTable:
    """What an algorithm (a plug-in's too) returned, checked to be a compute-only table of the requested shape
    on the placement it was registered with (the projection and zb-auto cost it by that), whose nodes name its
    chunks and microbatches; raises :class:`AlgorithmOutputError` naming the algorithm, its module and what
    differs."""
    who = _who(info)
    if not isinstance(table, ScheduleTable):
        raise AlgorithmOutputError(f"{who} returned {_kind_of(table)}, not a ScheduleTable; return "
                                   "ScheduleTable.build(placement, microbatches, rows)")
    want = {"pp": request.pp, "microbatches": request.microbatches, "vpp": request.vpp}
    for name, wanted in want.items():
        if wanted is not None and getattr(table, name) != wanted:
            raise AlgorithmOutputError(f"{who} was asked for {name}={wanted} but returned a table with "
                                       f"{name}={getattr(table, name)}; build the requested shape or raise "
                                       "ScheduleShapeError for one it cannot serve")
    layouts = [Placement.named(name, table.pp, table.vpp) for name in ("interleaved", "v")
               if info.placement in (name, "any") and (name != "v" or table.vpp == 2)]
    if table.placement not in layouts:
        raise AlgorithmOutputError(f"{who} is registered with placement {info.placement!r} but returned the "
                                   f"placement {table.placement.name!r} {strict.show(table.placement.stages)}; build "
                                   "on Placement.interleaved(pp, vpp) or Placement.vshape(pp) as registered")
    if table.has_communication:
        raise AlgorithmOutputError(f"{who} returned SEND/RECV nodes; an algorithm returns a compute-only table "
                                   "(build_schedule adds communication)")
    if table.splits_backward and not info.split_backward:
        raise AlgorithmOutputError(f"{who} is registered with split_backward=False but returned a table that splits "
                                   "its backward (B and W nodes); register it with split_backward=True")
    try:
        check_structure(table)
    except ValidationError as exc:
        raise AlgorithmOutputError(f"{who}: {str(exc).splitlines()[0]}") from None
    return _labelled(info, table)


def _labelled(info: AlgorithmInfo, table: ScheduleTable) -> ScheduleTable:
    """``table`` labelled with the algorithm that built it, whatever label its function gave it: a plug-in that
    wraps a built-in returns a table labelled ``1f1b``, one that builds rows by hand ``custom``, and a dump, a
    calibration or a report would credit that name with this algorithm's schedule (an alias keeps its target's
    name, as the built-ins label theirs)."""
    name = info.alias_of or info.name
    return table if table.algorithm == name else dataclasses.replace(table, algorithm=name)


def _kind_of(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
