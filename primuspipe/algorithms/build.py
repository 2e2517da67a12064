"""The one call that turns an algorithm name and a shape into a validated, runnable table."""

from __future__ import annotations

from typing import Any

from primuspipe.algorithms import ScheduleRequest, get_algorithm
from primuspipe.passes.communication import add_communication
from primuspipe.ir import strict
from primuspipe.ir.costs import ComputeCosts
from primuspipe.errors import ConfigError, ScheduleShapeError
from primuspipe.ir.table import ScheduleTable, check_shape
from primuspipe.passes.validation import validate


def build_schedule(
    algorithm: str,
    pp: int,
    microbatches: int,
    vpp: int | None = None,
    *,
    costs: ComputeCosts | None = None,
    memory_limit: float | None = None,
    communication: bool = True,
    **options: Any,
) -> ScheduleTable:
    """Build ``algorithm``'s table for the shape, add communication and validate it.

    ``vpp`` defaults to what the algorithm requires, else its default (1, or 2 for interleaved-1f1b). Raises :class:`ScheduleShapeError` when the
    algorithm refuses the shape or it is too large to build (:func:`~primuspipe.ir.table.check_shape`) and
    :class:`ConfigError` for unknown options or values of the wrong type.

    >>> t = build_schedule("1f1b", pp=2, microbatches=3)
    >>> [str(n) for n in t.ranks[1]][:6]
    ['RECV_F0.0<0', 'F0.0', 'RECV_F1.0<0', 'BW0.0', 'SEND_B0.0>0', 'F1.0']
    """
    info = get_algorithm(algorithm)
    vpp = info.resolve_vpp(vpp)
    for name, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleShapeError(f"{algorithm}: {name} must be an integer >= 1, got {value!r}")
    if info.vpp is not None and vpp != info.vpp:
        raise ScheduleShapeError(f"{algorithm} needs vpp = {info.vpp}, got vpp = {vpp}")
    check_shape(pp, vpp, microbatches)
    options = info.check_options(options)
    if memory_limit is not None:
        strict.number(memory_limit, "memory_limit", above=0)
    if costs is not None and costs.num_stages != pp * vpp:
        raise ConfigError(f"costs describe {costs.num_stages} stages but pp*vpp = {pp * vpp}")
    table = info.build(ScheduleRequest(pp, vpp, microbatches, costs, memory_limit), **options)
    assert (table.pp, table.vpp, table.microbatches) == (pp, vpp, microbatches), f"{algorithm} built the wrong shape"
    assert not table.has_communication, f"{algorithm} must return a compute-only table"
    if communication:
        table = add_communication(table)
    return validate(table)
