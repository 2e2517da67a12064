"""Every registered algorithm's table at given small shapes: what the transport tests replay, simulate and
reorder."""

from primuspipe.algorithms.build import build_schedule
from primuspipe.algorithms.registry import list_algorithms
from primuspipe.errors import PrimusPipeError
from primuspipe.ir.table import ScheduleTable


def shipped_tables(shapes, *, each_vpp: bool = False, searches: bool = True) -> list[ScheduleTable]:
    """Per algorithm, per ``(pp, m)`` of ``shapes``, the table it builds (shapes it refuses are skipped);
    ``each_vpp``: interleaved algorithms at vpp 1 and 2 (else each at its default); ``searches``: zb-auto too."""
    tables = []
    for info in list_algorithms():
        if info.placement == "any" and not searches:
            continue
        vpps = [1, 2] if each_vpp and info.placement == "interleaved" and not info.vpp else [None]
        for pp, m in shapes:
            for vpp in vpps:
                try:
                    tables.append(build_schedule(info.name, pp, m, vpp))
                except PrimusPipeError:
                    continue
    return tables
