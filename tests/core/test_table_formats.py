import json

import pytest
from hypothesis import given
from schedule_strategies import tables

from primuspipe.errors import TableFormatError
from primuspipe.ir.formats import dump_table, from_torch_csv, load_table, to_torch_csv
from primuspipe.ir.placement import Placement
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import validate


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


def _torch_schedule_csv(schedule_cls, n_stages, pp, microbatches, path, fmt):
    """Let torch.distributed.pipelining build one of its own schedules and write its CSV."""
    import torch
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    class Stage:  # the schedule only reads these attributes while building its order
        def __init__(self, index):
            self.stage_index, self.num_stages, self.group_rank, self.group_size = index, n_stages, 0, pp
            self.submod = torch.nn.Identity()

    stages = [Stage(i) for i in range(n_stages // pp)]
    sched = schedule_cls(stages, microbatches, loss_fn=lambda a, b: a.sum())
    pipeline_order = sched.pipeline_order
    runtime = _PipelineScheduleRuntime(stages, microbatches, loss_fn=lambda a, b: a.sum())
    runtime.pipeline_order = pipeline_order
    runtime._validate_and_set_stage_mapping(pipeline_order)
    runtime._prepare_schedule_with_comms(pipeline_order)
    runtime._dump_csv(str(path), format=fmt)
    return path


@pytest.mark.parametrize("name, n_stages, pp, m", [("ScheduleInterleaved1F1B", 4, 2, 4), ("ScheduleInterleavedZeroBubble", 8, 4, 8), ("ScheduleLoopedBFS", 4, 2, 2)])
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_csv_written_by_torch_pipelining_loads_and_validates(tmp_path, name, n_stages, pp, m, fmt):
    import torch.distributed.pipelining.schedules as sched_mod

    path = _torch_schedule_csv(getattr(sched_mod, name), n_stages, pp, m, tmp_path / "s.csv", fmt)
    table = load_table(path)
    assert (table.pp, table.num_stages, table.microbatches) == (pp, n_stages, m)
    assert table.has_communication == (fmt == "compute_comms")
    validate(table)
    from primuspipe.passes.communication import add_communication

    validate(add_communication(table.compute_only()))


def test_dump_table_formats():
    table = build_schedule("interleaved-1f1b", 2, 4, 2)
    assert ScheduleTable.from_json(dump_table(table, "json")) == table
    assert not ScheduleTable.from_json(dump_table(table, "json", compute_only=True)).has_communication
    with pytest.raises(TableFormatError, match="unknown format"):
        dump_table(table, "xml")
