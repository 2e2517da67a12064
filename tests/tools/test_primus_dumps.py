"""Primus's dump layout (its runs' dump_pp_data and its simulator's output) read by ``vis`` and
``calibrate``. The fixtures are written here from the documented layout (docs/primus.md), from
simulated steps whose every node time is known, so reading them back can be checked exactly."""

import json
import math

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.calibration.measure import measure_costs
from primuspipe.cli import main
from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.placement import Placement
from primuspipe.simulator import CostModel, simulate
from primuspipe.tools.pp_vis import load_iterations, load_timeline

SERIES = {NodeKind.F: "fwd", NodeKind.B: "bwd", NodeKind.BW: "bwd", NodeKind.W: "wgrad"}


def simulated(algorithm, pp, m, f=1.0, b=1.0, w=1.0, vpp=None):
    cost = CostModel.per_stage(pp, f, b, w)
    table = build_schedule(algorithm, pp, m, vpp)
    return simulate(table, cost.for_shape(pp, table.vpp)).timeline()


def primus_record(rank_timeline, labels=True):
    """One rank's iteration as Primus writes it: per series start/end (ms) and, unless ``labels`` is off
    (runs of Megatron's own schedules), microbatch and chunk; an FB node is an fwd and a bwd event with one
    interval, as Primus's combined forward-backward wrapper records it."""
    record = {"total": max(e.end for e in rank_timeline.events), "memory": 1.5}
    for name in ("fwd", "bwd", "wgrad"):
        record.update({f"{name}_start": [], f"{name}_end": [], f"{name}_minibatch": [], f"{name}_chunk": []})
    for event in sorted(rank_timeline.events, key=lambda e: e.start):
        for kind, mb, chunk in event.node.parts():
            name = SERIES[kind]
            record[f"{name}_start"].append(event.start)
            record[f"{name}_end"].append(event.end)
            if labels:
                record[f"{name}_minibatch"].append(mb)
                record[f"{name}_chunk"].append(chunk)
    return record


def write_primus_run(folder, timelines, labels=True):
    """A Primus training run's dump folder: config.json plus pp_rank_<r>.json keyed by iteration from 1."""
    first = timelines[0]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "world_size": first.pp, "dp_size": 1, "tp_size": 1, "ep_size": 1, "pp_size": first.pp,
        "vp_size": first.vpp, "num_mbs": first.microbatches, "train_iters": len(timelines)}))
    for rank in range(first.pp):
        data = {str(i + 1): primus_record(t.ranks[rank], labels) for i, t in enumerate(timelines)}
        (folder / f"pp_rank_{rank}.json").write_text(json.dumps(data))
    return folder


def write_primus_simulation(output_dir, name, timeline):
    """A Primus simulator result folder: config.json (pp_size, vpp_size, micro_batches) and pp_rank_<r>.json
    keyed "0", memory in activation units."""
    folder = output_dir / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"pp_size": timeline.pp, "vpp_size": timeline.vpp,
                                                    "micro_batches": timeline.microbatches}))
    for rank in range(timeline.pp):
        record = {**primus_record(timeline.ranks[rank]), "memory": 2.0, "activation_memory_usage": [1.0, 2.0]}
        (folder / f"pp_rank_{rank}.json").write_text(json.dumps({"0": record}))
    return folder


def compute_events(timeline):
    return sorted((rt.rank, str(e.node), e.start, e.end) for rt in timeline.ranks for e in rt.events
                  if e.node.kind.is_compute)


@pytest.mark.parametrize("algorithm,pp,m,placement", [("zb-h1", 4, 8, "interleaved"), ("zbv", 4, 8, "v"),
                                                      ("interleaved-1f1b", 2, 4, "interleaved"),
                                                      ("dualpipe-v", 4, 8, "v")])
def test_run_dump_reads_back_node_for_node(tmp_path, algorithm, pp, m, placement):
    source = simulated(algorithm, pp, m, b=2.0)
    folder = write_primus_run(tmp_path / "pp_data", [source, source])
    got = load_timeline(folder)
    assert (got.source, got.pp, got.vpp, got.microbatches, got.iteration, got.time_unit) == \
        ("run", pp, source.vpp, m, 2, "ms")
    assert compute_events(got) == compute_events(source)
    assert Placement.from_dict(got.meta["placement"]) == Placement.named(placement, pp, source.vpp)
    assert [r.peak_memory_bytes for r in got.ranks] == [int(1.5 * 1024 ** 3)] * pp
    assert [t.iteration for t in load_iterations(folder)] == [1, 2]
    assert load_timeline(folder, 1).iteration == 1


@pytest.mark.parametrize("algorithm,vpp", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_megatron_native_run_without_labels_follows_megatrons_order(tmp_path, algorithm, vpp):
    source = simulated(algorithm, 4, 8, vpp=vpp)
    folder = write_primus_run(tmp_path / "native", [source], labels=False)
    assert compute_events(load_timeline(folder)) == compute_events(source)


def test_simulator_output_renders_and_calibrates(tmp_path, capsys):
    output_dir = tmp_path / "pp_simulation_result"
    source = simulated("v-half", 4, 8, f=1000.0, b=1000.0, w=1000.0)
    folder = write_primus_simulation(output_dir, "v-half", source)
    write_primus_simulation(output_dir, "zbv-formatted", simulated("zbv", 4, 8))
    with pytest.raises(TableFormatError, match="2 Primus dump folders.*v-half.*pass one"):
        load_timeline(output_dir)
    got = load_timeline(folder)
    assert (got.source, got.algorithm, got.iteration) == ("simulator", "v-half", 0)
    assert got.meta["activation_peaks"] == [2.0] * 4 and all(r.peak_memory_bytes is None for r in got.ranks)
    png, html = tmp_path / "v.png", tmp_path / "v.html"
    assert main(["vis", str(folder), "--png", str(png), "--html", str(html), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["timeline"]
    assert png.stat().st_size > 0 and html.stat().st_size > 0
    assert stats["step_time"] == source.step_time and stats["time_unit"] == "ms"
    cost = tmp_path / "measured.yaml"
    assert main(["calibrate", str(folder), "-o", str(cost)]) == 0
    assert main(["simulate", "--algorithm", "v-half", "--pp", "4", "-m", "8", "--cost", str(cost), "--json"]) == 0
    assert f'"step_time": {source.step_time}' in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")


def test_calibrate_recovers_the_costs_of_a_primus_run(tmp_path, capsys):
    f, b, w = [1.0, 1.5], [2.0, 2.5], [0.5, 1.0]
    steps = [simulated("zb-h1", 2, 4, f=[3 * x for x in f], b=b, w=w), simulated("zb-h1", 2, 4, f=f, b=b, w=w)]
    folder = write_primus_run(tmp_path / "pp_data", steps)
    measured = measure_costs(load_iterations(folder))  # the first iteration is the warm-up
    assert (measured.forward, measured.backward_input, measured.backward_weight) == (tuple(f), tuple(b), tuple(w))
    assert measured.time_unit == "ms" and measured.iterations == (2,)
    cost = tmp_path / "cost.yaml"
    assert main(["calibrate", str(folder), "-o", str(cost)]) == 0
    assert "iterations 2" in capsys.readouterr().out
    assert main(["vis", str(folder), "--cost", str(cost), "--json"]) == 0  # the run beside its replay
    comparison = json.loads(capsys.readouterr().out)["comparison"]
    step = next(f for f in comparison["figures"] if f["name"].startswith("step time"))
    assert step["run"] == steps[-1].step_time and step["difference"] == 0
    assert comparison["order_differences"] == []


def test_overlapped_forward_backward_is_one_node(tmp_path):
    source = simulated("dualpipe-v", 4, 8)
    assert any(e.node.kind is NodeKind.FB for rt in source.ranks for e in rt.events)
    got = load_timeline(write_primus_run(tmp_path / "fb", [source]))
    assert sum(e.node.kind is NodeKind.FB for rt in got.ranks for e in rt.events) == \
        sum(e.node.kind is NodeKind.FB for rt in source.ranks for e in rt.events)


@pytest.mark.parametrize("edit,match", [
    (lambda cfg, rank0: cfg.pop("pp_size"), "'pp_size' must be an integer"),
    (lambda cfg, rank0: rank0["1"].update(fwd_start=rank0["1"]["fwd_start"][:-1]), "fwd_start has 7 entries but fwd_end 8"),
    (lambda cfg, rank0: rank0["1"]["bwd_end"].__setitem__(0, math.nan), r"bwd_end\[0\] must be a finite number"),
    (lambda cfg, rank0: rank0["1"]["fwd_minibatch"].__setitem__(0, 99), "microbatch 99, chunk 0 is outside"),
    (lambda cfg, rank0: rank0.pop("1"), "no iteration is in every pp_rank"),
])
def test_bad_dumps_name_file_and_field(tmp_path, edit, match):
    folder = write_primus_run(tmp_path / "pp_data", [simulated("zb-h1", 2, 8)])
    cfg, rank0 = (json.loads((folder / name).read_text()) for name in ("config.json", "pp_rank_0.json"))
    edit(cfg, rank0)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "pp_rank_0.json").write_text(json.dumps(rank0))
    with pytest.raises(TableFormatError, match=match):
        load_timeline(folder)
