"""Algorithms are pure functions of their request: every registered one, asked the same request after every
other has run, gives the same table, and leaves the cost model it was given as it was. A cache or module state
that one build leaves for the next would show here as a different table."""

import pytest

from primuspipe.algorithms import list_algorithms
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel

PP, MICROBATCHES = 4, 8

FAST = {"zb-auto": {"fills": 3, "use_milp": False}}
"""zb-auto's own constructions at a small work bound (its MILP has its own determinism tests)."""


def _cost() -> CostModel:
    """Uneven per 1F1B stage, so cost-aware algorithms have choices to make."""
    return CostModel.per_stage(PP, [1.0, 1.3, 0.8, 1.1], [2.0, 2.2, 1.7, 2.1], [1.0, 0.6, 1.2, 0.9])


def _build(name: str, cost: CostModel):
    return build_schedule(name, PP, MICROBATCHES, cost=cost, **FAST.get(name, {}))


@pytest.mark.parametrize("name", [info.name for info in list_algorithms()])
def test_the_same_request_gives_the_same_table_whatever_ran_before(name):
    cost = _cost()
    first = _build(name, cost)
    for info in list_algorithms():
        _build(info.name, cost)
    assert _build(name, cost) == first
    assert _build(name, _cost()) == first  # an equal, fresh cost model: nothing keyed by identity
    assert cost.to_dict() == _cost().to_dict(), f"{name} changed the cost model it was given"
