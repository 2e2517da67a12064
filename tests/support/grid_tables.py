"""Small-shape tables two sweeps both build, built once: the zero-bubble family's sweeps
(tests/algorithms/conftest.py's ``sweep_grid``: zb-h1, zb-h2, zbv, v-half, v-min at pp 1..8, m 1..3pp+1) keep
their plain builds here, and the every-algorithm grid (tests/core/test_algorithm_grid.py, which builds the same
shapes later in the session) takes each kept one instead of building it again, and drops it. A V table at pp 8
takes a few tenths of a second to build and validate; the two sweeps built the same 580 tables. Tables are frozen
(immutable nodes); a refusal is kept as its :class:`ScheduleShapeError` and raised again. Run alone, the grid finds
nothing kept and builds every shape itself."""

from primuspipe.algorithms import get_algorithm
from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.table import ScheduleTable

_KEPT: dict[tuple[str, int, int, int | None], ScheduleTable | ScheduleShapeError] = {}


def _key(algorithm: str, pp: int, m: int, vpp: int | None) -> tuple[str, int, int, int | None]:
    """vpp None and the vpp the algorithm resolves it to are one build: ``build_schedule`` resolves it first."""
    return algorithm, pp, m, get_algorithm(algorithm).resolve_vpp(vpp)


def _build(algorithm: str, pp: int, m: int, vpp: int | None) -> ScheduleTable | ScheduleShapeError:
    try:
        return build_schedule(algorithm, pp, m, vpp)
    except ScheduleShapeError as exc:
        return exc


def _table(result: ScheduleTable | ScheduleShapeError) -> ScheduleTable:
    if isinstance(result, ScheduleShapeError):
        raise result
    return result


def kept_table(algorithm: str, pp: int, m: int, vpp: int | None = None) -> ScheduleTable:
    """``build_schedule(algorithm, pp, m, vpp)``, kept for :func:`taken_table`."""
    key = _key(algorithm, pp, m, vpp)
    if key not in _KEPT:
        _KEPT[key] = _build(*key)
    return _table(_KEPT[key])


def taken_table(algorithm: str, pp: int, m: int, vpp: int | None = None) -> ScheduleTable:
    """The kept build of the shape, handed over and no longer kept, else a build of its own."""
    key = _key(algorithm, pp, m, vpp)
    return _table(_KEPT.pop(key) if key in _KEPT else _build(*key))
