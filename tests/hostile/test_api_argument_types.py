"""The Python API's entry points given arguments of the wrong type, each parameter in turn: ``validate(None)``
passed (None was "proven"), ``simulate`` and ``build_schedule`` with a dict for a cost model raised an
AttributeError, a float microbatch failed deep in a pass, ``F(True)`` ran as microbatch 1, a placement of
``"2"`` ranks was a TypeError, a negative pair in an overlapped node gave a completeness line naming nothing.
Each is one PrimusPipeError line naming the argument."""

import pytest

from hostile_support import refused, run_api
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.node import BW, FB, ScheduleNode, B, F, W
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import validate
from primuspipe.simulator import simulate

TABLE = build_schedule("1f1b", 2, 4)
COST = CostModel.per_stage(2, 1.0, 1.0, 1.0)

WRONG = {
    "count": [None, "x", "2", 2.5, 2.0, True, [], {}, (2,), object(), -1],
    "index": [None, "x", "0", 0.5, 1.0, True, [], {}, object(), -1],
    "table": [None, "x", 3, 2.5, {}, [], TABLE.to_dict(), TABLE.to_json(), object()],
    "cost": ["x", 3, {}, [], {"compute": {"f": 1, "b": 1, "w": 1}}, object()],
    "text": [None, 3, 2.5, True, [], {}, object()],
    "placement": [None, "interleaved", 2, {}, ((0,), (1,)), object()],
}
"""Values of the wrong type for each kind of parameter."""

ENTRIES = [
    ("build_schedule", build_schedule, {"algorithm": "1f1b", "pp": 2, "microbatches": 4}, {"pp": "count",
                                                                                      "microbatches": "count"}),
    ("build_schedule", build_schedule, {"algorithm": "zb-h1", "pp": 2, "microbatches": 4}, {"cost": "cost"}),
    ("simulate", simulate, {"table": TABLE, "cost": COST}, {"table": "table", "cost": "cost"}),
    ("validate", validate, {"table": TABLE}, {"table": "table"}),
    ("CostModel.per_stage", CostModel.per_stage, {"num_stages": 2, "f": 1, "b": 1, "w": 1}, {"num_stages": "count"}),
    ("Placement.interleaved", Placement.interleaved, {"pp": 2, "vpp": 1}, {"pp": "count", "vpp": "count"}),
    ("Placement.vshape", Placement.vshape, {"pp": 2}, {"pp": "count"}),
    ("ScheduleTable.build", ScheduleTable.build,
     {"placement": TABLE.placement, "microbatches": 4, "ranks": TABLE.ranks}, {"placement": "placement",
                                                                               "microbatches": "count"}),
    ("ScheduleNode.parse", ScheduleNode.parse, {"text": "F0.0"}, {"text": "text"}),
    *((f"{kind.__name__}", kind, {"mb": 0, "chunk": 0}, {"mb": "index", "chunk": "index"}) for kind in (F, B, W, BW)),
    ("FB", FB, {"f_mb": 0, "f_chunk": 0, "b_mb": 0, "b_chunk": 0},
     {"f_mb": "index", "f_chunk": "index", "b_mb": "index", "b_chunk": "index"}),
]


def _cases():
    for name, fn, valid, params in ENTRIES:
        for param, kind in params.items():
            for value in WRONG[kind]:
                yield f"{name} {param}={type(value).__name__}:{str(value)[:12]}", fn, {**valid, param: value}


CASES = list(_cases())


@pytest.mark.parametrize("case, fn, kwargs", CASES, ids=[c[0] for c in CASES])
def test_wrong_type(case, fn, kwargs):
    refused(run_api(fn, **kwargs), case=f"API {case}")


@pytest.mark.parametrize("name, fn, valid, params", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_the_valid_arguments_are_accepted(name, fn, valid, params):
    """The arguments each case above changes one of are themselves valid: the refusal is the wrong value's."""
    fn(**valid)
