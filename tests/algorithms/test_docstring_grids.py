"""Each algorithm's docstring draws its schedule at pp=4 (the target schedule above the code); the
drawing must be what the algorithm builds, so it can never drift from the code."""

import inspect
import re

import pytest

from primuspipe.algorithms import list_algorithms
from primuspipe.algorithms.build import build_schedule

_SHAPE = re.compile(r"compute order at pp=(\d+), m=(\d+)")
_ROW = re.compile(r"^\s*(rank \d+ \|.*)$")

DRAWN = list_algorithms()  # zb-auto's search is bounded by work, so its order is as fixed as the others'.


@pytest.mark.parametrize("info", DRAWN, ids=lambda a: a.name)
def test_the_docstring_grid_is_what_the_algorithm_builds(info):
    doc = inspect.getdoc(info.build) or ""
    shape = _SHAPE.search(doc)
    assert shape, f"{info.name}'s docstring should draw its order ('compute order at pp=4, m=...' and a grid)"
    pp, m = map(int, shape.groups())
    drawn = [match[1].rstrip() for line in doc[shape.end():].splitlines() if (match := _ROW.match(line))]
    built = build_schedule(info.name, pp, m, communication=False).compact_grid().splitlines()
    assert drawn == built

