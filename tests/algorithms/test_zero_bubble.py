"""ZB-H1 and ZB-H2: every small shape validates, and the paper's bubble and memory figures hold."""

import pytest

from primuspipe.ir.node import NodeKind
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, simulate
from primuspipe.ir.activations import peak_in_flight


@pytest.mark.parametrize("algorithm", ["zb-h1", "zb-h2"])
def test_every_small_shape_builds_and_validates(algorithm, sweep_grid):
    built, refused, tables = sweep_grid(algorithm)
    assert refused == 0 and built == sum(3 * p + 1 for p in range(1, 9))
    for t in tables:  # split backward, never a node past the last microbatch (build_schedule validated)
        kinds = {n.kind for row in t.ranks for n in row if n.kind.is_compute}
        assert kinds == {NodeKind.F, NodeKind.B, NodeKind.W}


@pytest.mark.parametrize("algorithm, cap", [("zb-h1", lambda p, r: p - r), ("zb-h2", lambda p, r: 2 * (p - r) - 1)])
def test_memory_per_rank_on_the_grid(algorithm, cap):
    """Counted from F until B (the warm-up), rank r holds its cap; counted until W (what the device
    holds), no rank more than rank 0's cap."""
    for p in (1, 3, 6):
        for m in (1, p, 3 * p + 1):
            table = build_schedule(algorithm, p, m)
            peaks = peak_in_flight(table, retained=0.0)
            assert all(peak <= min(cap(p, r), m) for r, peak in enumerate(peaks)), (p, m, peaks)
            assert max(peak_in_flight(table, retained=1.0)) <= min(cap(p, 0), m), (p, m)


def test_reference_figures_pp8_m32(cli_figures):
    """docs/design.md §7: 1F1B 0.180; ZB-H1 (p-1)(F+B-W) bubble at 1F1B's memory; ZB-H2 near zero at 2p-1."""
    one_f_one_b, h1, h2 = (cli_figures(a) for a in ("1f1b", "zb-h1", "zb-h2"))
    assert one_f_one_b["bubble_rate"] == pytest.approx(7 / 39, abs=5e-4)
    assert h1["bubble_rate"] <= 0.069 and max(h1["peak_activations"]) <= 8
    assert h1["step_time"] == 32 * 3 + 7 * (1 + 1 - 1)
    assert max(h2["peak_activations"]) <= 2 * 8 - 1
    # rank p-1 cannot start before p-1 forwards have passed, so with the whole step as the window
    # the best possible is (p-1)F / step; ZB-H2 reaches exactly that, and within each rank's own
    # span (the paper's figure) it is bubble-free
    assert h2["bubble_rate"] == pytest.approx(7 / (96 + 7), abs=1e-9)
    assert h2["bubble_rate_span"] <= 0.02
    assert one_f_one_b["bubble_rate_span"] == pytest.approx(7 / 39, abs=5e-4)


COST_CASES = {
    "B twice F, W half": ((1, 2, 0.5), {}),
    "heterogeneous stages": (([1, 1.5, 1, 2], [2, 2, 3, 2], [0.5, 1, 0.5, 1]), {"zb-h2": 64.0}),
}


@pytest.mark.parametrize("case", sorted(COST_CASES))
@pytest.mark.parametrize("algorithm", ["zb-h1", "zb-h2"])
def test_non_uniform_costs_drive_the_fill(algorithm, case):
    """Planning with the real costs gives a different table, never slower under those costs than the
    unit-cost plan, and faster where the W's have room to move (ZB-H2 on uneven stages). With W's
    bounded in number (memory), ZB-H1's plan is often already as good."""
    (f, b, w), expected = COST_CASES[case]
    model = CostModel.per_stage(4, f, b, w)
    aware = build_schedule(algorithm, 4, 12, cost=model)
    blind = build_schedule(algorithm, 4, 12)
    assert aware.compute_only().ranks != blind.compute_only().ranks
    assert simulate(aware, model).step_time <= simulate(blind, model).step_time
    if algorithm in expected:
        assert simulate(aware, model).step_time == expected[algorithm] < simulate(blind, model).step_time


def test_memory_counted_until_w_is_1f1bs_whatever_the_microbatch_count():
    """A W keeps most of its layer's activations alive (the inputs of every GEMM), so a microbatch is
    counted from its F until its W: ZB-H1 then holds at most p on every rank (1F1B's peak) and ZB-H2
    2p - 1, the same at m = 4p as at m = 16p."""
    for algorithm, bound in (("zb-h1", 8), ("zb-h2", 15)):
        for m in (32, 128):
            for row in build_schedule(algorithm, 8, m).compute_only().ranks:
                held = worst = 0
                for node in row:
                    held += {"F": 1, "W": -1}.get(node.kind.name, 0)
                    worst = max(worst, held)
                assert worst <= bound, (algorithm, m, worst)
