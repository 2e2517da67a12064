"""Hypothesis strategies shared by the core tests: random valid shapes of every registered algorithm."""

from hypothesis import assume
from hypothesis import strategies as st

from primuspipe.algorithms import list_algorithms
from primuspipe.errors import ScheduleShapeError
from primuspipe.algorithms.build import build_schedule

FAST = [a for a in list_algorithms() if a.placement != "any"]  # a search (zb-auto) has its own tests


@st.composite
def tables(draw, max_pp=6):
    info = draw(st.sampled_from(FAST))
    pp = draw(st.integers(1, max_pp))
    vpp = info.vpp or draw(st.integers(1, 3))
    m = draw(st.integers(1, 3 * pp + 1))
    try:
        return build_schedule(info.name, pp, m, vpp)
    except ScheduleShapeError:
        assume(False)
