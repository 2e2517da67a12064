"""Round fifteen: ``HostCost.overhead`` built in code (docs/simulator.md), whose ``(kind, time)`` pairs name compute
kinds by the lower-case names a cost file's ``host.overhead`` keys use -- generated from the kinds table, so a new
kind joins the sweep: each compute kind's name in capitals or with a space, given twice (at one time or two), the
names of the communication kinds, and names of no kind.

Each was kept and never charged (``("zz", 1.0)``, ``("F", 1.0)``: :meth:`HostCost.before` looks a node's kind up by
its lower-case name), or a kind given twice charged whichever came last; a cost file refused all of them
(``strict.keys``). Now each is one line naming ``host.overhead`` and the name."""

from __future__ import annotations

import dataclasses

import pytest

from hostile_support import accepted, refused, run_api
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.cost_parts import HostCost
from primuspipe.ir.kinds import all_kinds, compute_kinds
from primuspipe.simulator import simulate

NAMES = [k.name.lower() for k in compute_kinds()]


def _cases():
    for name in NAMES:
        yield f"{name} in capitals", ((name.upper(), 0.1),), name.upper()
        yield f"{name} with a space", ((f" {name}", 0.1),), name
        yield f"{name} twice at one time", ((name, 0.1), (name, 0.1)), name
        yield f"{name} twice at two times", ((name, 0.1), (name, 0.2)), name
    for kind in all_kinds():
        if not kind.is_compute:
            yield f"the communication kind {kind.name}", ((kind.name.lower(), 0.1),), kind.name.lower()
    for name in ("zz", "", "forward", "f\u200b", "f\x1b[31m"):
        yield f"no kind {name!r}", ((name, 0.1),), "host.overhead"


CASES = list(_cases())


@pytest.mark.parametrize("case, overhead, named", CASES, ids=[c[0] for c in CASES])
def test_an_overhead_that_names_no_compute_kind_once(case, overhead, named):
    refused(run_api(HostCost, overhead=overhead), "host.overhead", named.strip() if named.isprintable() else "",
            case=f"HostCost.overhead: {case}")


@pytest.mark.parametrize("name", NAMES)
def test_each_compute_kind_overhead_is_charged(name):
    """Each compute kind's own name builds (sound), and a table running that kind takes longer by its overhead."""
    accepted(run_api(HostCost, overhead=((name, 0.5),)), case=f"HostCost.overhead: {name}")
    table = build_schedule("zb-h1" if name in ("b", "w") else "1f1b", 2, 4)
    base = CostModel.per_stage(2, 1.0, 1.0, 1.0)
    runs = {k.name.lower() for row in table.ranks for k in (node.kind for node in row)}
    slower = simulate(table, dataclasses.replace(base, host=HostCost(overhead=((name, 0.5),)))).step_time
    assert (slower > simulate(table, base).step_time) == (name in runs), name
