"""The papers' schedules as code, and the record of which construction a table is.

The zero-bubble algorithms write their papers' schedules out (the ZB-H1/ZB-H2 pattern, the V-min and
V-half blocks, ZBV's hand-crafted order) and keep the fastest of their candidate constructions; the
table's ``construction`` says which one it is and what the simulator made of it and of the paper's.
"""

import json
from dataclasses import replace

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.algorithms.building_blocks import paper_block, vshape_block
from primuspipe.algorithms.zero_bubble import zero_bubble_pattern
from primuspipe.cli import main
from primuspipe.errors import PrimusPipeError, TableFormatError
from primuspipe.ir.cost_model import CostModel, Link, P2PCost
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import validate
from primuspipe.runtime.driver import table_digest
from primuspipe.simulator import simulate

ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv", "v-half", "v-min")
COSTS = [(1, 1, 1), (1, 2, 1), (1, 1, 0.5), (2, 1, 1), (1, 1.5, 0.25)]
SHAPES = [(2, 2), (2, 5), (3, 4), (4, 3), (4, 8), (5, 11), (6, 12)]


def _compute_rows(table: ScheduleTable):
    return table.compute_only().ranks


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h1_is_the_papers_pattern_at_uniform_costs(p):
    """Rank r warms up with p - r forwards, then runs B, the W of r backwards ago, F (the paper's figure)."""
    for m in (p, p + 1, 2 * p, 3 * p + 1):
        table = build_schedule("zb-h1", pp=p, microbatches=m)
        pattern = [zero_bubble_pattern(m, p - r, r) for r in range(p)]
        assert [list(row) for row in _compute_rows(table)] == pattern
        assert table.construction.name == table.construction.paper == "the paper's ZB-H1 pattern"


def test_the_zero_bubble_pattern_reads_as_the_paper_draws_it():
    assert " ".join(str(n).split(".")[0] for n in zero_bubble_pattern(6, 2, 2)) == \
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5"


@pytest.mark.parametrize("p, m", SHAPES)
@pytest.mark.parametrize("name, warmup, lag", [("zb-h1", lambda p, r: p - r, lambda p, r: r),
                                              ("zb-h2", lambda p, r: 2 * (p - r) - 1, lambda p, r: 2 * r)])
def test_the_patterns_are_valid_schedules_within_their_memory(name, warmup, lag, p, m):
    rows = [zero_bubble_pattern(m, warmup(p, r), lag(p, r)) for r in range(p)]
    table = validate(add_communication(ScheduleTable.build(Placement.interleaved(p, 1), m, rows, name)),
                     max_in_flight=p if name == "zb-h1" else 2 * p - 1, retained=1.0)
    assert table.pp == p


@pytest.mark.parametrize("p", range(2, 33))
def test_the_v_min_block_is_the_chain_layout_the_competition_squeezes(p):
    """The paper's V-min block is the unit-grid chain (turning two slots late where p % 3 == 0), one of
    the blocks that compete; its four nodes per rank never share a slot of the period."""
    placement = Placement.vshape(p)
    unit = CostModel.per_stage(2 * p, 1, 1, 1)
    assert paper_block(placement, "v-min").starts == vshape_block(placement, unit, 0, 2 if p % 3 == 0 else 0).starts


@pytest.mark.parametrize("p", range(2, 33))
@pytest.mark.parametrize("schedule, memory", [("v-min", lambda p: (p + 4) // 3), ("v-half", lambda p: (p + 2) // 2)])
def test_the_papers_blocks_are_collision_free_with_their_memory(schedule, memory, p):
    """Each rank's F/B slots of one microbatch are distinct modulo the period of 6, and its two
    lifespans (F start to B end, chunk by chunk) fit in the paper's memory: with a new microbatch every
    period, a rank holds lifespans / 6 chunk activations, half as many 1F1B-stage microbatches; V-min
    about p/3, V-half about p/2."""
    placement = Placement.vshape(p)
    block = paper_block(placement, schedule)
    for rank in range(p):
        slots = [int(t) % 6 for (kind, stage), t in block.starts.items() if placement.rank_of(stage) == rank]
        assert len(set(slots)) == 4, (rank, slots)
        span = sum(block.starts[(k, s)] for k, s in block.starts if placement.rank_of(s) == rank and k.name == "B") \
            - sum(block.starts[(k, s)] for k, s in block.starts if placement.rank_of(s) == rank and k.name == "F") + 2
        assert span / 12 <= memory(p), (rank, span)


@pytest.mark.parametrize("algorithm", ZERO_BUBBLE)
@pytest.mark.parametrize("costs", COSTS)
def test_the_record_says_which_construction_and_its_simulated_step(algorithm, costs):
    p, m = 4, 9
    cost = CostModel.per_stage(2 * p if algorithm in ("zbv", "v-half", "v-min") else p, *costs)
    table = build_schedule(algorithm, pp=p, microbatches=m, cost=cost)
    record = table.construction
    assert record is not None and record.candidates >= 1 and record.paper is not None
    assert record.step_time == pytest.approx(simulate(table, cost).step_time)
    if record.name == record.paper:  # named the paper's only when it is the paper's table
        assert record.paper_step_time == pytest.approx(record.step_time)
    if algorithm in ("zbv", "v-min"):  # the paper's schedule is one of the candidates (free P2P: all are timed)
        assert record.step_time <= record.paper_step_time + 1e-9, "the competition keeps the faster"


def test_the_papers_schedule_wins_where_it_is_faster():
    """V-half's paper block is faster than every fill at this shape: it is the table, and the record
    names it."""
    cost = CostModel.per_stage(8, 1, 1.5, 0.25)
    table = build_schedule("v-half", pp=4, microbatches=9, cost=cost)
    record = table.construction
    assert record.name == record.paper == "the paper's V-half block"
    assert record.step_time == record.paper_step_time == simulate(table, cost).step_time


@pytest.mark.parametrize("algorithm", ZERO_BUBBLE)
@pytest.mark.parametrize("p2p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("costs", COSTS)
def test_never_slower_than_the_papers_schedule(algorithm, p2p, costs):
    """Where an algorithm writes out its paper's schedule and it runs at the shape, the table is never
    slower than it (P2P time is where greedy fills lost to the patterns, by up to 9 %)."""
    f, b, w = costs
    for p, m in SHAPES[1:5]:
        pp_stages = 2 * p if algorithm in ("zbv", "v-half", "v-min") else p
        cost = CostModel.per_stage(pp_stages, f, b, w, p2p=P2PCost(intra_node=Link(p2p), inter_node=Link(p2p)))
        try:
            table = build_schedule(algorithm, pp=p, microbatches=m, cost=cost)
        except PrimusPipeError:  # shapes an algorithm refuses (too few microbatches)
            continue
        record = table.construction
        step = simulate(table, cost).step_time
        assert step == pytest.approx(record.step_time)
        if record.paper_step_time is not None:
            assert step <= record.paper_step_time + 1e-9, (p, m, record)


def test_the_record_survives_json_and_the_passes():
    table = build_schedule("v-half", pp=4, microbatches=8)
    again = ScheduleTable.from_json(table.to_json())
    assert again == table and again.construction == table.construction
    assert table.compute_only().construction == table.construction
    assert build_schedule("1f1b", pp=2, microbatches=2).construction is None
    bare = replace(table, construction=None)  # as read from a file written before the record existed
    assert table_digest(bare) == table_digest(table), "ranks agree on the nodes, whatever the record"


@pytest.mark.parametrize("field, value, match", [
    ("step_time", "fast", r"construction.step_time"), ("candidates", 0, r"construction.candidates"),
    ("name", 3, r"construction.name"), ("extra", 1, r"construction.*extra"),
    ("paper_step_time", -1, r"construction.paper_step_time")])
def test_a_bad_construction_in_json_is_named(field, value, match):
    data = build_schedule("zb-h1", pp=2, microbatches=3).to_dict()
    data["construction"][field] = value
    with pytest.raises(TableFormatError, match=match) as err:
        ScheduleTable.from_json(json.dumps(data), "t.json")
    assert "\n" not in str(err.value) and "t.json" in str(err.value)


def test_show_and_simulate_report_the_construction(capsys):
    assert main(["show", "zb-h1", "--pp", "4", "-m", "8"]) == 0
    assert "construction: the paper's ZB-H1 pattern, simulated step 27 (best of 3 candidates)" in capsys.readouterr().out
    assert main(["simulate", "-a", "v-min", "--pp", "4", "-m", "8", "--b", "2", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["construction"]["paper"] == "the paper's V-min block"
    assert row["construction"]["step_time"] == row["step_time"], "planned and simulated with the same costs"
    assert main(["simulate", "-a", "v-min", "--pp", "4", "-m", "8", "--b", "2"]) == 0
    assert f"how v-min was built (timed with its planning costs): {row['construction']['name']}" in capsys.readouterr().out
