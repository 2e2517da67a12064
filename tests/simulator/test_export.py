"""Timeline (shared format) and Chrome/Perfetto trace export."""

import json
from collections import Counter

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, Link, P2PCost, chrome_trace, simulate, write_chrome_trace
from primuspipe.io.timeline import Timeline


@pytest.fixture(scope="module")
def result():
    table = build_schedule("interleaved-1f1b", pp=3, microbatches=3, vpp=2)
    return simulate(table, CostModel.per_stage(6, 1, 2, 1, p2p=P2PCost(intra_node=Link(latency=0.5)), time_unit="ms"))


def test_timeline_round_trips_through_json(result, tmp_path):
    timeline = result.timeline()
    assert timeline.source == "simulator" and timeline.time_unit == "ms"
    assert timeline.step_time == result.step_time
    assert timeline.meta["placement"] == result.table.placement.to_dict()
    assert timeline.meta["bubble_rate"] == result.bubble_rate
    loaded = Timeline.load(timeline.save(tmp_path / "t.json"))
    assert loaded == timeline
    assert [len(r.events) for r in loaded.ranks] == [len(row) for row in result.table.ranks]


def test_trace_is_valid_chrome_json_with_matched_flows(result, tmp_path):
    path = write_chrome_trace(tmp_path / "trace.json", result.timeline(), result.table.placement)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list)
    for e in events:
        assert {"ph", "pid", "tid", "name"} <= set(e)
        assert e["ph"] in {"M", "X", "s", "f"}
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in slices)
    # one track per rank, every compute node on it, times in microseconds (ms x 1000)
    assert Counter(e["tid"] for e in slices) == {r: sum(n.kind.is_compute for n in row)
                                                 for r, row in enumerate(result.table.ranks)}
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(result.step_time * 1000)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    sends = sum(n.kind.is_send for row in result.table.ranks for n in row)
    assert len(starts) == len(finishes) == sends > 0
    for flow_id, s in starts.items():
        f = finishes[flow_id]
        assert f["bp"] == "e" and f["name"] == s["name"] and s["tid"] != f["tid"]
        assert f["ts"] >= s["ts"]
        # each end lies inside a slice on its own track, so viewers can bind the arrow
        assert any(x["tid"] == s["tid"] and x["ts"] <= s["ts"] <= x["ts"] + x["dur"] for x in slices)
        assert any(x["tid"] == f["tid"] and x["ts"] == f["ts"] for x in slices)
        assert s["args"]["send_posted"] <= s["args"]["arrived"] and f["ts"] >= s["args"]["arrived"] * 1000


def test_trace_of_a_timeline_without_communication_nodes_still_has_flows():
    table = build_schedule("1f1b", pp=2, microbatches=2, communication=False)
    result = simulate(table, CostModel.per_stage(2, 1, 1, 1, time_unit="s"))
    compute_only = Timeline("run", "1f1b", 2, 1, 2, tuple(
        type(r)(r.rank, tuple(e for e in r.events if e.node.kind.is_compute)) for r in result.timeline().ranks))
    trace = chrome_trace(compute_only, table.placement)
    assert sum(e["ph"] == "s" for e in trace["traceEvents"]) == 4  # 2 activations + 2 gradients
