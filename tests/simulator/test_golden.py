"""Golden figures (docs/design.md §7) and hand-computed critical paths, zero-cost communication."""

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, simulate
from primuspipe.ir.activations import peak_in_flight

FBW = [(1, 1, 1), (1, 2, 0), (1.5, 0.7, 0.3), (2, 1, 0)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_1f1b_bubble_rate_for_any_f_and_b(p, m):
    table = build_schedule("1f1b", pp=p, microbatches=m)
    for f, b, w in FBW:
        result = simulate(table, CostModel.per_stage(p, f, b, w))
        expected = (p - 1) / (m + p - 1)
        assert result.bubble_rate == pytest.approx(expected)
        assert result.bubble_rate_mean == pytest.approx(expected)  # uniform stages: every rank idles alike
        assert result.step_time == pytest.approx((m + p - 1) * (f + b + w))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 3])
def test_interleaved_bubble_rate_when_m_is_a_multiple_of_p(p, v, groups):
    m = groups * p
    table = build_schedule("interleaved-1f1b", pp=p, microbatches=m, vpp=v)
    for f, b, w in FBW[:3]:
        result = simulate(table, CostModel.per_stage(p * v, f, b, w))
        assert result.bubble_rate == pytest.approx((p - 1) / (v * m + p - 1))


def test_reference_figure_pp8_m32():
    result = simulate(build_schedule("1f1b", pp=8, microbatches=32), CostModel.per_stage(8, 1, 1, 1))
    assert round(result.bubble_rate, 4) == 0.1795
    assert result.step_time == 117  # (m + p - 1) * (F + B + W)
    assert [r.busy_time for r in result.ranks] == [96.0] * 8


@pytest.mark.parametrize("p,m", [(4, 2), (4, 4), (4, 9), (8, 32), (5, 3)])
def test_1f1b_peak_in_flight_is_min_of_p_minus_r_and_m(p, m):
    table = build_schedule("1f1b", pp=p, microbatches=m)
    result = simulate(table, CostModel.per_stage(p, 1, 1, 1))
    assert result.peak_activations == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("algorithm,v", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("gpipe", 2), ("gpipe", 1)])
def test_peak_units_agree_with_the_validator(algorithm, v):
    table = build_schedule(algorithm, pp=4, microbatches=8, vpp=v)
    assert simulate(table, CostModel.per_stage(4 * v, 1, 2, 0)).peak_activations == peak_in_flight(table)


def test_one_stage_twice_as_slow_two_ranks():
    """pp=2, m=2; stage 1 twice as slow (F=2, BW=4 against F=1, BW=2).

    rank 0: F0 [0,1] F1 [1,2] BW0 waits for rank 1's BW0 -> [7,9], BW1 waits -> [13,15]
    rank 1: F0 [1,3] BW0 [3,7] F1 [7,9] BW1 [9,13]
    Critical path F0@0 + F0@1 + BW0@1 + F1@1 + BW1@1 + BW1@0 = 1+2+4+2+4+2 = 15.
    """
    result = simulate(build_schedule("1f1b", pp=2, microbatches=2), CostModel.per_stage(2, [1, 2], [2, 4], 0))
    assert result.step_time == 15
    assert [r.bubble_rate for r in result.ranks] == [pytest.approx(9 / 15), pytest.approx(3 / 15)]
    rank0 = [(str(e.node), e.start, e.end) for e in result.ranks[0].events if e.node.kind.is_compute]
    assert rank0 == [("F0.0", 0, 1), ("F1.0", 1, 2), ("BW0.0", 7, 9), ("BW1.0", 13, 15)]


def test_slow_middle_stage_sets_the_critical_path():
    """pp=4, m=8, stage 2 twice as slow (F=2, BW=4; others F=1, BW=2).

    The slow stage is the bottleneck: it starts after two fast forwards (2), waits once for stage 3's
    first F+BW (3) while it has only F1 (2) to do (1 idle), then computes 8 x 6 = 48 back to back, and
    its last BW is followed by the fast BWs of stages 1 and 0 (4): 2 + 1 + 48 + 4 = 55.
    """
    cost = CostModel.per_stage(4, [1, 1, 2, 1], [2, 2, 4, 2], 0)
    result = simulate(build_schedule("1f1b", pp=4, microbatches=8), cost)
    assert result.step_time == 55
    assert result.ranks[2].busy_time == 48
    assert result.ranks[2].bubble_rate == pytest.approx(7 / 55)
