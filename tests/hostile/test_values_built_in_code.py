"""Round fourteen: the values a user builds in code rather than reads from a file -- the cost model and its parts
(``CostModel``, ``ComputeCosts``, ``Link``, ``P2PCost``, ``HostCost``, ``MemoryCost``, ``LateWork``; docs/simulator.md
names them), a plug-in's node kind (``KindSpec``, ``define_kind``; docs/design.md §8) and a ``ScheduleTable`` made by
its constructor -- with each field, in turn, at values of another type, generated from the field's own annotation
(so a new field joins the sweep), and a plug-in kind's spec wrong in each way its consumers could not run.

Defects this family found, each now one PrimusPipeError line naming the class and the field (or the kind):
``Link("1")``, ``HostCost(send="1")``, ``MemoryCost(w_retained_fraction="0.5")`` were TypeErrors inside their own
range checks; ``CostModel(compute, p2p=1.0)`` (and ``host={}``, ``memory=None``, ``late_w={...}``,
``CostModel.per_stage(..., p2p=nan)``) an AttributeError in the time-range check; ``fused_backward`` with a NaN, or a
negative ``w_warm``, simulated a step (the range check skips what is not > 0); ``P2PCost(ranks_per_node=2.5)`` and
``LateWork(stage=0.5)`` were kept; ``KindSpec(category="compute")`` defined a kind that ran as neither compute nor
communication, ``name=3`` was an AttributeError, ``"ÄB"`` a name no table text parses, a NaN activation effect, a
stream, cost key, handler or colour no consumer knows, parts or steps that name no kind were all defined silently;
``ScheduleTable(placement, m, None)`` and a generator of rows were TypeErrors, rows given as lists made a table
that could not be hashed, a construction given as text was kept."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from hostile_support import accepted, refused, run_api, wrong_values
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.cost_parts import HostCost, LateWork, Link, MemoryCost, P2PCost
from primuspipe.ir.costs import ComputeCosts
from primuspipe.ir.kinds import Category, KindSpec, define_kind, forget_kind
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import validate
from primuspipe.simulator import simulate

COMPUTE = ComputeCosts((1.0, 1.0), (1.0, 1.0), (1.0, 1.0))
VALID = {
    Link: {"latency": 0.1, "bandwidth": 2.0},
    LateWork: {"stage": 1, "first": 2, "time": 0.5},
    P2PCost: {"message_bytes": 8.0, "intra_node": Link(), "inter_node": Link(0.2, 4.0), "ranks_per_node": 4},
    HostCost: {"overhead": (("f", 0.1),), "send": 0.01, "recv": 0.01, "cores": 2.0, "background": 0.05,
               "contention": 0.1, "step_gap": (0.1, 0.1), "speed": 0.9, "message_cpu": 0.001},
    MemoryCost: {"w_retained_fraction": 0.5, "activation_bytes": (1e6, 1e6), "parameter_bytes": (1e6, 1e6),
                 "gradient_bytes": (1e6, 1e6), "optimizer_bytes": (1e6, 1e6), "offload_fraction": 0.5,
                 "b_rise_fraction": 0.1, "w_excess_fraction": 0.1},
    ComputeCosts: {"forward": (1.0, 1.0), "backward_input": (1.0, 1.0), "backward_weight": (1.0, 1.0),
                   "other": (("recompute", (0.5, 0.5)),)},
    CostModel: {"compute": COMPUTE, "fused_backward": (1.5, 1.5), "fb_overlap": 0.5, "p2p": P2PCost(),
                "host": HostCost(), "cold_start": COMPUTE, "memory": MemoryCost(), "time_unit": "ms",
                "fixed": (("f", (0.1, 0.1), (0.1, 0.1)),), "host_link": Link(), "w_warm": (0.5, 0.5),
                "probe_window": 0.1, "late_w": LateWork(1, 2, 0.5), "source": "built in code"},
    KindSpec: {"name": "PROBE_X", "category": Category.COMPUTE, "label": "probe", "completes": ("PROBE_X",),
               "needs": (("F", 0),), "parts": (), "optional": True, "activation": (0.0, 0.0), "rise": 0.0,
               "offload": 0.0, "stream": "compute", "cost": "probe", "carries": None, "peer_offset": 0,
               "torch_action": None, "color": "#aaaa00", "handler": "probe"},
}
"""A valid value of every field of each class (each case below changes one)."""


def _field_cases():
    for cls, valid in VALID.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            for value in wrong_values(hints[field.name]):
                yield f"{cls.__name__}.{field.name}={value!r:.24}", cls, {**valid, field.name: value}, field.name


FIELD_CASES = list(_field_cases())


@pytest.mark.parametrize("case, cls, kwargs, name", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_a_field_of_another_type(case, cls, kwargs, name):
    """Refused when built, naming the field (a NaN by its range check, which names the field too)."""
    refused(run_api(cls, **kwargs), name.split("_")[-1], case=f"built in code: {case}")


@pytest.mark.parametrize("cls", VALID, ids=[c.__name__ for c in VALID])
def test_the_valid_fields_are_accepted(cls):
    """Every field at its valid value, lists where tuples belong included, builds (sound)."""
    listed = {k: list(v) if isinstance(v, tuple) else v for k, v in VALID[cls].items()}
    accepted(run_api(cls, **VALID[cls]), case=f"built in code: {cls.__name__}")
    accepted(run_api(cls, **listed), case=f"built in code: {cls.__name__} (lists)")


BAD_KINDS = {
    "a name outside ASCII": {"name": "PRÖBE"},
    "a name with digits": {"name": "PROBE2"},
    "a lower-case name": {"name": "probe"},
    "a built-in name": {"name": "F"},
    "a step no kind runs": {"completes": ("ZZZ",)},
    "a need no kind completes": {"needs": (("ZZZ", 0),)},
    "a need of a lower-case step": {"needs": (("f", 0),)},
    "one part": {"parts": ("F",), "completes": (), "needs": ()},
    "three parts": {"parts": ("F", "B", "W"), "completes": (), "needs": ()},
    "a part no kind": {"parts": ("F", "ZZZ"), "completes": (), "needs": ()},
    "an overlapped part": {"parts": ("F", "FB"), "completes": (), "needs": ()},
    "a part that is a send": {"parts": ("F", "SEND_F"), "completes": (), "needs": ()},
    "a NaN activation": {"activation": (math.nan, 0.0)},
    "an infinite rise": {"rise": math.inf},
    "a NaN offload": {"offload": math.nan},
    "a stream no runner has": {"stream": "gpu"},
    "a cost key with a space": {"cost": "re compute"},
    "a cost key in capitals": {"cost": "RECOMPUTE"},
    "a handler that is no name": {"handler": "run probe"},
    "a colour no drawing takes": {"color": "yellow"},
    "a compute kind that carries": {"carries": "F"},
    "a compute kind with a peer": {"peer_offset": 1},
    "a send that carries nothing": {"category": Category.SEND, "completes": (), "needs": (), "peer_offset": 1},
    "a receive without a peer": {"category": Category.RECV, "completes": (), "needs": (), "carries": "F"},
    "a send carrying no step": {"category": Category.SEND, "completes": (), "needs": (), "carries": "ZZZ",
                                "peer_offset": 1},
}
"""A plug-in kind's spec (:data:`VALID`'s) wrong in one way its consumers -- the text form, the validator, the
simulator's cost lookup, the binders, the drawings -- cannot run."""


def _define(**changes):
    kind = define_kind(KindSpec(**{**VALID[KindSpec], **changes}))
    forget_kind(kind)


@pytest.mark.parametrize("case", BAD_KINDS)
def test_a_plug_in_kind_spec(case):
    refused(run_api(_define, **BAD_KINDS[case]), case=f"define_kind: {case}")


def test_a_plug_in_kind_spec_that_is_valid():
    accepted(run_api(_define), case="define_kind: the valid spec")


TABLE = build_schedule("1f1b", 2, 4)
BAD_TABLES = {
    "rows None": {"ranks": None},
    "rows a number": {"ranks": 3},
    "a row a number": {"ranks": (TABLE.ranks[0], 3)},
    "a construction as text": {"construction": "zb-h1"},
    "a construction as a dict": {"construction": {"name": "x"}},
}


@pytest.mark.parametrize("case", BAD_TABLES)
def test_a_table_built_by_its_constructor(case):
    kwargs = {"placement": TABLE.placement, "microbatches": 4, "ranks": TABLE.ranks, **BAD_TABLES[case]}
    refused(run_api(ScheduleTable, **kwargs), case=f"ScheduleTable: {case}")


@pytest.mark.parametrize("spelling", ["lists", "a generator"])
def test_a_table_whose_rows_are_not_tuples(spelling):
    """Rows given as lists (or a generator) make the same table: it validates, simulates and hashes (sound)."""
    rows = [list(row) for row in TABLE.ranks] if spelling == "lists" else (row for row in TABLE.ranks)

    def use():
        table = ScheduleTable(TABLE.placement, 4, rows, TABLE.algorithm)
        assert table == TABLE and hash(table) == hash(TABLE)
        validate(table)
        simulate(table, CostModel.per_stage(2, 1, 1, 1))

    accepted(run_api(use), case=f"ScheduleTable: rows as {spelling}")
