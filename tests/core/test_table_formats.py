"""Tables as JSON and as torch.distributed.pipelining CSV: lossless both ways, torch's own CSVs
included, and refusals that name the stage at fault."""

import csv
import io
import json
import re

import pytest
from hypothesis import given
from schedule_strategies import tables

from primuspipe.errors import TableFormatError, ValidationError
from primuspipe.io.formats import (
    dump_table, from_torch_csv, load_table, read_torch_csv, save_table, sidecar_path, to_torch_csv,
)
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import validate
from primuspipe.testing.torch_pipelining import SCHEDULE_CLASSES, is_single_stage, torch_orders


@given(tables())
def test_json_round_trip_is_lossless(table):
    assert ScheduleTable.from_json(table.to_json()) == table


@given(tables())
def test_torch_csv_round_trip_is_lossless(table):
    back = from_torch_csv(to_torch_csv(table))
    assert back.ranks == table.ranks and back.placement == table.placement
    compute = from_torch_csv(to_torch_csv(table, compute_only=True))
    assert compute.ranks == table.compute_only().ranks


def test_grid_marks_offending_nodes():
    table = build_schedule("1f1b", 2, 2)
    text = table.grid(marks=[(1, 0)])
    assert ">>RECV_F0.0<0<<" in text.splitlines()[2]
    assert text.splitlines()[0].startswith("1f1b: pp=2 vpp=1 microbatches=2")


def test_placements():
    v = Placement.vshape(4)
    assert v.stages == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert v.locate(4) == (3, 1) and v.rank_of(7) == 0
    loop = Placement.interleaved(4, 2)
    assert loop.stage(1, 1) == 5 and loop.locate(5) == (1, 1)
    with pytest.raises(TableFormatError, match="one-to-one"):
        Placement("custom", ((0, 1), (1, 2)))


def test_bad_json_and_csv_are_refused(tmp_path):
    with pytest.raises(TableFormatError, match="not valid JSON"):
        ScheduleTable.from_json("{")
    with pytest.raises(TableFormatError, match="format"):
        ScheduleTable.from_json(json.dumps({"ranks": []}))
    with pytest.raises(TableFormatError, match="cannot read action '0FOO1'"):
        from_torch_csv("0FOO1,0F0\n")
    assert from_torch_csv("0UNSHARD,0F0,0B0,0RESHARD\n").ranks == from_torch_csv("0F0,0B0\n").ranks
    with pytest.raises(TableFormatError, match="cannot read"):
        load_table(tmp_path / "missing.json")


def test_dump_table_formats():
    table = build_schedule("interleaved-1f1b", 2, 4, 2)
    assert ScheduleTable.from_json(dump_table(table, "json")) == table
    assert not ScheduleTable.from_json(dump_table(table, "json", compute_only=True)).has_communication
    with pytest.raises(TableFormatError, match="unknown format"):
        dump_table(table, "xml")


def _cells(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


TORCH_SHAPES = [(2, 4), (4, 8), (4, 5)]
"""(pp, microbatches); interleaved classes use 2 chunks per rank."""


@pytest.mark.parametrize("name", SCHEDULE_CLASSES)
def test_every_torch_schedule_csv_round_trips_cell_for_cell(name):
    """Each torch 2.13 schedule class's CSV, compute-only and with communication, loads into primuspipe
    and writes back identically: bubbles, OVERLAP_F_B with I or B, UNSHARD, RESHARD, REDUCE_GRAD."""
    checked = 0
    for pp, m in TORCH_SHAPES:
        if name == "ScheduleDualPipeV" and m < 2 * pp:
            continue  # torch refuses it
        vpp = 1 if is_single_stage(name) else 2
        for fmt, text in zip(("compute_only", "compute_comms"), torch_orders(name, pp, vpp, m)):
            if text is None:
                continue  # torch cannot lower its own order (Schedule1F1B, see below)
            read = read_torch_csv(text)
            assert _cells(read.text()) == _cells(text)
            table = read.table
            assert (table.pp, table.num_stages, table.microbatches) == (pp, pp * vpp, m)
            assert table.has_communication == (fmt == "compute_comms")
            if name != "Schedule1F1B":
                validate(table)
                validate(add_communication(table.compute_only()))
            checked += 1
    assert checked >= 3


def test_torch_overlapped_full_backward_reads_as_fbw():
    compute_only, comms = torch_orders("ScheduleDualPipeV", 2, 2, 4)
    table = read_torch_csv(compute_only).table
    kinds = {n.kind for _, _, n in table.positions()}
    assert NodeKind.FBW in kinds and NodeKind.BW in kinds and NodeKind.B in kinds
    node = next(n for _, _, n in table.positions() if n.kind is NodeKind.FBW)
    assert ScheduleNode.parse(str(node)) == node and "+BW" in str(node)
    validate(table)
    validate(read_torch_csv(comms).table)
    with pytest.raises(TableFormatError, match="an F .first. with an I or a B"):
        from_torch_csv("(0B0;0F1)OVERLAP_F_B\n")
    with pytest.raises(TableFormatError, match="exactly two"):
        from_torch_csv("(0F0;0F1;0I0)OVERLAP_F_B\n")


@pytest.mark.parametrize("name, vpp", [("ScheduleInterleaved1F1B", 2), ("ScheduleZBVZeroBubble", 2),
                                       ("ScheduleDualPipeV", 2), ("ScheduleGPipe", 1)])
def test_written_resource_actions_are_torch_lowerings(name, vpp):
    """The UNSHARD/RESHARD/REDUCE_GRAD primuspipe writes for a table are the ones torch's own lowering
    adds to the same compute order: each sits next to the same compute action."""
    compute_only, comms = torch_orders(name, 4, vpp, 8)
    table = add_communication(read_torch_csv(compute_only).table.compute_only())
    ours, theirs = _cells(to_torch_csv(table)), _cells(comms)
    assert _resources_by_neighbour(ours) == _resources_by_neighbour(theirs)
    assert all(sum(c.endswith("REDUCE_GRAD") for c in row) == vpp for row in ours)


def _resources_by_neighbour(rows):
    """Per rank: each UNSHARD/RESHARD with the next compute action, each REDUCE_GRAD with the one before."""
    out = []
    for row in rows:
        compute = [(i, c) for i, c in enumerate(row) if c and not re.search(r"SEND|RECV|SHARD|REDUCE", c)]
        pairs = []
        for i, c in enumerate(row):
            if c.endswith(("UNSHARD", "RESHARD")):
                pairs.append((c, next((a for j, a in compute if j > i), None)))
            elif c.endswith("REDUCE_GRAD"):
                pairs.append((c, [a for j, a in compute if j < i][-1]))
        out.append(sorted(pairs, key=str))
    return out


def test_torch_1f1b_order_is_blamed_on_the_stage_that_is_incomplete():
    """torch 2.13's Schedule1F1B order skips F0 on the last rank and runs F{m} there instead. The count
    comes from the complete stages, so the refusal names the last stage, not stage 0."""
    compute_only, comms = torch_orders("Schedule1F1B", 4, 1, 8)
    assert comms is None  # torch cannot lower it either
    table = read_torch_csv(compute_only).table
    assert table.microbatches == 8
    with pytest.raises(ValidationError, match=r"rank 3 node \d+ \(F8\.0\)"):
        validate(table)
    without_stray = table.with_ranks([n for n in row if n.microbatch < 8] for row in table.ranks)
    with pytest.raises(ValidationError, match=r"stage 3 \(rank 3, chunk 0\), microbatch 0 has 0 forwards"):
        validate(without_stray)


def test_missing_last_microbatch_is_blamed_on_its_stage():
    table = build_schedule("zbv", 4, 8)
    text = "\n".join(",".join(c for c in row if c != "5W7") for row in _cells(to_torch_csv(table, compute_only=True)))
    with pytest.raises(ValidationError, match=r"stage 5 \(rank 2, chunk 1\), microbatch 7"):
        validate(from_torch_csv(text))


def test_primuspipe_csv_reduces_gradients_once_per_stage_after_its_last_weight_gradient():
    table = build_schedule("zbv", 2, 4)
    rows = _cells(to_torch_csv(table))
    for rank, row in enumerate(rows):
        for stage in table.placement.stages[rank]:
            at = row.index(f"{stage}REDUCE_GRAD")
            last_w = max(i for i, c in enumerate(row) if re.fullmatch(rf"{stage}W\d+", c))
            assert last_w < at and all("SEND" in c for c in row[last_w + 1:at])
            assert row.count(f"{stage}UNSHARD") == row.count(f"{stage}RESHARD") == 1
    assert not any("SHARD" in c or "REDUCE" in c for row in _cells(to_torch_csv(table, compute_only=True)) for c in row)


def test_sidecar_keeps_microbatches_and_algorithm(tmp_path):
    table = build_schedule("dualpipe-v", 2, 6)
    path = tmp_path / "s.csv"
    assert save_table(table, path) == [path, sidecar_path(path)]
    back = load_table(path)
    assert (back.algorithm, back.microbatches, back.ranks) == ("dualpipe-v", 6, table.ranks)
    # a CSV where no stage runs its last microbatch: only the sidecar knows the count
    trimmed = build_schedule("1f1b", 2, 3)
    path.write_text("\n".join(",".join(c for c in row if not c.endswith("2")) for row in _cells(to_torch_csv(trimmed))))
    save = sidecar_path(path).read_text()
    sidecar_path(path).write_text(save.replace('"microbatches": 6', '"microbatches": 3').replace('"vpp": 2', '"vpp": 1'))
    with pytest.raises(ValidationError, match="microbatch 2"):
        validate(load_table(path))
    sidecar_path(path).write_text(save)
    with pytest.raises(TableFormatError, match="sidecar belongs to another schedule"):
        load_table(path)
    sidecar_path(path).write_text("{}")
    with pytest.raises(TableFormatError, match="not a primuspipe torch CSV sidecar"):
        load_table(path)
