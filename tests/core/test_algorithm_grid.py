"""Every registered algorithm, every small shape: a validated table or the project's refusal."""

import pytest

from grid_tables import taken_table
from primuspipe.algorithms import list_algorithms
from primuspipe.errors import ScheduleShapeError
from primuspipe.algorithms.build import build_schedule
from primuspipe.passes.validation import validate


def _shapes(info):
    for pp in range(1, 9):
        for vpp in [info.vpp] if info.vpp else [1, 2, 3] if info.placement != "any" else [None, 3]:
            for m in range(1, 3 * pp + 2):
                yield pp, vpp, m


@pytest.mark.slow
@pytest.mark.parametrize("info", list_algorithms(), ids=lambda a: a.name)
def test_every_shape_validates_or_is_refused(info):
    # zb-auto's own constructions on every placement, at small work bounds (the fixed algorithms it also
    # times have their own rows here)
    fast = {"fills": 3, "use_milp": False, "include_fixed": False} if info.name == "zb-auto" else {}
    built = refused = 0
    for pp, vpp, m in _shapes(info):
        try:
            table = build_schedule(info.name, pp, m, vpp, **fast) if fast else taken_table(info.name, pp, m, vpp)
        except ScheduleShapeError as exc:
            assert info.name in str(exc)
            refused += 1
            continue
        # build_schedule validated the full table; the compute-only form must validate too
        validate(table.compute_only())
        assert (table.pp, table.microbatches) == (pp, m) and vpp in (None, table.vpp)
        built += 1
    assert built > 0, f"{info.name} refused every shape"
