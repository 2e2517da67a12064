"""pp_vis: loading dumps, PNG, HTML, Perfetto trace, and run vs simulated comparison."""

import json
import struct
from dataclasses import replace

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from primuspipe.errors import TableFormatError
from primuspipe.ir.node import NodeKind
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, Link, P2PCost, simulate
from primuspipe.tools.pp_vis import (
    compare_timelines,
    draw_png,
    in_unit,
    load_iterations,
    load_timeline,
    replay,
    timeline_figure,
    timeline_stats,
    write_html,
    write_trace,
)
from primuspipe.tools.pp_vis.style import kind_color, node_color

PP, M = 4, 8
COST = CostModel.per_stage(PP, f=[1.0, 1.0, 1.5, 1.0], b=1.0, w=1.0, p2p=P2PCost(intra_node=Link(0.1)), time_unit="s")


@pytest.fixture(scope="module")
def run():
    """A zb-h1 step as a run would dump it (seconds), with measured peak memory."""
    result = simulate(build_schedule("zb-h1", pp=PP, microbatches=M), COST)
    ranks = tuple(replace(r, peak_memory_bytes=(r.rank + 1) * 2**30) for r in result.timeline().ranks)
    return replace(result.timeline(), source="run", ranks=ranks, meta={})


def _compute_nodes(timeline):
    return sorted((rt.rank, str(e.node)) for rt in timeline.ranks for e in rt.events if e.node.kind.is_compute)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "a PNG file"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# -- loading ---------------------------------------------------------------------------------------
def test_dump_directory_is_merged_on_one_time_axis(run, write_dump):
    slow = replace(run, ranks=tuple(replace(r, events=tuple(replace(e, start=3 * e.start, end=3 * e.end)
                                                              for e in r.events)) for r in run.ranks))
    dump_dir = write_dump([slow, run], skew=0.25)
    merged = load_timeline(dump_dir)  # default: the last iteration
    assert merged.iteration == 1 and merged.source == "run" and merged.pp == PP
    offset = (PP - 1) * 0.25  # the earliest clock (rank pp-1's) is the origin
    for got, want in zip(merged.ranks, run.ranks):
        assert [str(e.node) for e in got.events] == [str(e.node) for e in sorted(want.events, key=lambda e: (e.start, e.end))]
        assert sorted(e.start for e in got.events) == pytest.approx(sorted(e.start + offset for e in want.events))
        assert got.peak_memory_bytes == want.peak_memory_bytes
    assert merged.step_time == pytest.approx(run.step_time)
    assert load_timeline(dump_dir, iteration=0).step_time > 2 * run.step_time
    assert load_timeline(dump_dir / "iter_000000").iteration == 0
    assert [t.iteration for t in load_iterations(dump_dir)] == [0, 1]


def test_unreadable_inputs_say_what_to_pass(tmp_path, run, write_dump):
    with pytest.raises(TableFormatError, match="dump directory"):
        load_timeline(tmp_path / "missing")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(TableFormatError, match="not a primuspipe timeline"):
        load_timeline(tmp_path / "junk.json")
    with pytest.raises(TableFormatError, match="iteration 5 .*dumped iterations: \\[0\\]"):
        load_timeline(write_dump([run]), iteration=5)
    path = run.save(tmp_path / "one.timeline.json")
    with pytest.raises(TableFormatError, match="only be chosen in a dump directory"):
        load_timeline(path, iteration=0)
    assert load_timeline(tmp_path) == run  # a folder with exactly one timeline


def test_units_convert_exactly():
    sim = simulate(build_schedule("1f1b", pp=2, microbatches=2), CostModel.per_stage(2, 1, 1, 1, time_unit="ms"))
    seconds = in_unit(sim.timeline(), "s")
    assert seconds.time_unit == "s" and seconds.step_time == pytest.approx(sim.step_time / 1000)
    with pytest.raises(TableFormatError, match="not one of"):
        in_unit(seconds, "minutes")


# -- drawings --------------------------------------------------------------------------------------
def test_png_is_a_readable_drawing_of_every_kind(run, tmp_path):
    one = draw_png(run, tmp_path / "run.png")
    width, height = _png_size(one)
    assert width == 1600 and 250 <= height <= 600
    pixels = imread(one)[..., :3]
    for kind in (NodeKind.F, NodeKind.B, NodeKind.W):  # each kind's colour fills a visible area
        share = np.all(np.abs(pixels - np.array(to_rgb(node_color(kind, 0, 1)))) < 0.02, axis=-1).mean()
        assert share > 0.005, kind
    two = draw_png([run, run], tmp_path / "two.png", marks={(0, run.ranks[0].events[0].node)})
    assert _png_size(two)[1] > height * 1.5
    red = np.all(np.abs(imread(two)[..., :3] - np.array(to_rgb("#d62728"))) < 0.05, axis=-1).sum()
    assert red > 20, "the marked node is outlined"


def test_png_of_chunks_and_overlapped_pairs(tmp_path):
    timeline = simulate(build_schedule("dualpipe-v", pp=4, microbatches=8), CostModel.per_stage(8, 1, 1, 1)).timeline()
    pixels = imread(draw_png(timeline, tmp_path / "dv.png", show_comm=False))[..., :3]
    for color in (kind_color(NodeKind.FB), node_color(NodeKind.F, 1, 2)):
        assert np.all(np.abs(pixels - np.array(to_rgb(color))) < 0.02, axis=-1).mean() > 0.002


def test_png_refuses_mixed_units(run, tmp_path):
    with pytest.raises(TableFormatError, match="one unit"):
        draw_png([run, in_unit(run, "ms")], tmp_path / "x.png")


def test_html_holds_every_node_with_hover_times(run, tmp_path):
    fig = timeline_figure(run)
    shown = sorted((row[4], row[0]) for trace in fig.data if trace.name.startswith(("F", "B", "W"))
                   for row in trace.customdata)
    assert shown == _compute_nodes(run)
    for trace in fig.data:
        for row, base, width in zip(trace.customdata, trace.base, trace.x):
            assert (row[1], row[2], row[3]) == (base, base + width, width)
        assert "start" in trace.hovertemplate and "duration" in trace.hovertemplate
    receives = [t for t in fig.data if t.name.startswith("receive")]
    assert len(receives) == 1 and receives[0].visible == "legendonly"
    path = write_html([run, run], tmp_path / "run.html")
    text = path.read_text()
    assert "plotly.js" in text or "Plotly.newPlot" in text
    assert 'src="http' not in text, "self-contained: plotly.js is embedded"
    for _, node in _compute_nodes(run):
        assert f'"{node}"' in text


def test_trace_of_a_run_uses_the_registered_placement(tmp_path):
    """A run timeline records no placement: a V-shape algorithm's flows must still bind to the right
    ranks (stage pp-1 -> pp is local, so it has no flow)."""
    sim = simulate(build_schedule("zbv", pp=4, microbatches=4), CostModel.per_stage(8, 1, 1, 1))
    run = replace(sim.timeline(), source="run", meta={})
    trace = json.loads(write_trace(run, tmp_path / "t.json").read_text())
    expected = json.loads(write_trace(sim.timeline(), tmp_path / "s.json").read_text())
    assert trace["traceEvents"][1:] == expected["traceEvents"][1:]  # all but the process name ("run")
    flows = [e for e in trace["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == sum(n.kind.is_send for row in sim.table.ranks for n in row) > 0
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == sum(n.kind.is_compute for row in sim.table.ranks for n in row)


# -- real vs simulated -----------------------------------------------------------------------------
def test_identical_timelines_compare_to_zero(run):
    comparison = compare_timelines(run, replay(run, COST))
    assert comparison.order_differences == () and not comparison.marked_nodes
    figures = {f.name: f for f in comparison.figures()}
    assert [n for n in figures if n.endswith("mean") and n[0] in "FBW"] == ["F mean", "B mean", "W mean"]
    for name, f in figures.items():
        if "memory" in name:
            assert f.simulated is None and f.difference is None, "the cost model has no memory section"
            continue
        assert f.difference == pytest.approx(0.0, abs=1e-12), name
    assert figures["step time"].run == pytest.approx(run.step_time)
    assert figures["F mean"].run == pytest.approx((3 * 1.0 + 1.5) / 4)


def test_perturbed_run_shows_its_differences(run):
    """The run's stage 2 forward is 1 s slower than the cost model says, and each of its nodes' mean
    difference, the step time and the bubbles follow."""
    slower = CostModel.per_stage(PP, f=[1.0, 1.0, 2.5, 1.0], b=1.0, w=1.0, p2p=COST.p2p, time_unit="s")
    perturbed = replace(simulate(build_schedule("zb-h1", pp=PP, microbatches=M), slower).timeline(), source="run")
    comparison = compare_timelines(perturbed, replay(perturbed, COST))
    figures = {f.name: f for f in comparison.figures()}
    assert figures["F mean"].difference == pytest.approx(-1.0 / PP)
    assert figures["B mean"].difference == pytest.approx(0.0, abs=1e-12)
    assert figures["W mean"].difference == pytest.approx(0.0, abs=1e-12)
    assert figures["step time"].run == pytest.approx(perturbed.step_time)
    assert figures["step time"].simulated == pytest.approx(run.step_time)
    assert figures["step time"].difference < 0
    stats = timeline_stats(perturbed)
    assert figures["bubble rate max"].run == pytest.approx(stats.bubble_rate)
    assert comparison.order_differences == (), "same table, same order"


def _with_cpu(timeline, share: float):
    """``timeline`` with every compute node's CPU time set to ``share`` of its duration."""
    def cpu(e):
        return replace(e, cpu=(0.0, share * (e.end - e.start))) if e.node.kind.is_compute else e
    return replace(timeline, ranks=[replace(r, events=tuple(map(cpu, r.events))) for r in timeline.ranks])


def test_cpu_means_sit_beside_the_durations_when_both_timelines_carry_them(run):
    """A run whose ranks waited for a core inside every node (CPU = half the duration) against a simulation
    whose nodes last their CPU time: the CPU means agree, the durations do not, and the stretch is named."""
    sim = replay(run, COST)
    comparison = compare_timelines(_with_cpu(run, 0.5), _with_cpu(sim, 1.0))
    figures = {f.name: f for f in comparison.figures()}
    assert figures["F CPU mean"].run == pytest.approx(figures["F mean"].run / 2)
    assert figures["F CPU mean"].simulated == pytest.approx(figures["F mean"].simulated)
    assert comparison.run_stretch == pytest.approx(1.0)
    without = compare_timelines(_with_cpu(run, 0.5), sim)
    assert not [n for n in (f.name for f in without.figures()) if "CPU" in n], "only where both carry CPU times"
    assert compare_timelines(run, sim).run_stretch == 0.0


def test_order_differences_name_the_swapped_nodes():
    cost = CostModel.per_stage(PP, 1, 1, 1)
    one_f_one_b = simulate(build_schedule("1f1b", pp=PP, microbatches=M), cost).timeline()
    gpipe = simulate(build_schedule("gpipe", pp=PP, microbatches=M), cost).timeline()
    comparison = compare_timelines(one_f_one_b, gpipe)
    orders = [[n for n in row if n.kind.is_compute] for row in build_schedule("1f1b", PP, M, communication=False).ranks]
    theirs = [[n for n in row if n.kind.is_compute] for row in build_schedule("gpipe", PP, M, communication=False).ranks]
    expected = [(r, i, a, b) for r in range(PP) for i, (a, b) in enumerate(zip(orders[r], theirs[r])) if a != b]
    assert [(d.rank, d.index, d.run, d.simulated) for d in comparison.order_differences] == expected
    assert len(expected) > 0 and (PP - 1, 1, orders[PP - 1][1], theirs[PP - 1][1]) in expected


def test_comparison_converts_units_and_refuses_other_shapes(run):
    sim = in_unit(replay(run, COST), "ms")
    comparison = compare_timelines(run, sim)
    assert comparison.simulated.time_unit == "s"
    assert {f.name: f.difference for f in comparison.figures()}["step time"] == pytest.approx(0.0, abs=1e-9)
    other = simulate(build_schedule("1f1b", pp=2, microbatches=2), CostModel.per_stage(2, 1, 1, 1)).timeline()
    with pytest.raises(TableFormatError, match="cannot compare"):
        compare_timelines(run, other)
