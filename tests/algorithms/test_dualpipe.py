"""DualPipe-V: overlapped FB nodes, its lowering to plain F/B/W, every small shape, bubble figure."""

import pytest

from primuspipe.passes.overlap import lower_overlap
from primuspipe.passes.communication import add_communication
from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.node import NodeKind
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, simulate
from primuspipe.passes.validation import validate


@pytest.mark.parametrize("overlap", [True, False])
def test_every_small_shape_builds_or_is_refused(overlap, sweep_grid):
    built, refused, tables = sweep_grid("dualpipe-v", overlap=overlap)
    assert built == sum(3 * p + 1 - (2 * p - 1) for p in range(1, 9))  # m >= 2p builds
    assert refused == sum(2 * p - 1 for p in range(1, 9))
    for t in tables:
        assert any(n.kind is NodeKind.FB for row in t.ranks for n in row) == overlap


def test_refuses_too_few_microbatches_with_a_hint():
    with pytest.raises(ScheduleShapeError, match="at least 2\\*pp = 8 microbatches"):
        build_schedule("dualpipe-v", 4, 7)


def test_lowering_keeps_the_order_and_validates():
    table = build_schedule("dualpipe-v", 4, 10, communication=False)
    lowered = lower_overlap(table)
    validate(add_communication(lowered))
    flat = [part for row in table.ranks for n in row for part in n.parts()]
    assert flat == [part for row in lowered.ranks for n in row for part in n.parts()]
    assert not any(n.kind is NodeKind.FB for row in lowered.ranks for n in row)
    assert build_schedule("dualpipe-v", 4, 10, overlap=False).compute_only() == lowered


def test_steady_phase_pairs_chunks_crosswise():
    """Phase 4 overlaps F of chunk 0 with B of chunk 1 and F of chunk 1 with B of chunk 0."""
    table = build_schedule("dualpipe-v", 4, 12, communication=False)
    pairs = {(n.chunk, n.pair[1]) for row in table.ranks for n in row if n.kind is NodeKind.FB}
    assert pairs == {(0, 1), (1, 0)}


def test_reference_figures_pp8_m32(cli_figures):
    row = cli_figures("dualpipe-v")
    assert row["bubble_rate"] <= 0.07


def test_overlap_gain_shortens_the_step():
    table = build_schedule("dualpipe-v", 4, 16)
    plain = simulate(table, CostModel.per_stage(8, 1, 1, 1)).step_time
    overlapped = simulate(table, CostModel.per_stage(8, 1, 1, 1, fb_overlap=1.0)).step_time
    lowered = simulate(build_schedule("dualpipe-v", 4, 16, overlap=False), CostModel.per_stage(8, 1, 1, 1)).step_time
    assert overlapped < plain == lowered
