"""The prediction path end to end on a real CPU run: gloo ranks run 1F1B with dump_pp_data, calibrate
measures a cost model from the dump (and reports how well it replays the run), and 'simulate --cost
FILE -a all' predicts the other algorithms. Timings are whatever this machine gives; what is checked
is that every stage runs on real dumps and that the figures agree with each other."""

import json

import pytest
import yaml

from primuspipe.cli import main
from primuspipe.tools.pp_vis import load_iterations

from real_runs import PP, M, train_1f1b as _train

STEPS = 4


def test_a_real_1f1b_run_is_calibrated_and_predicts_other_algorithms(tmp_path, capsys):
    dump = tmp_path / "pp_data"
    _train(dump, STEPS)
    timelines = load_iterations(dump)
    assert [t.iteration for t in timelines] == list(range(STEPS))
    assert all(e.cpu is not None for t in timelines for rt in t.ranks for e in rt.events), "CPU dumps carry CPU stamps"

    cost_file = tmp_path / "measured.yaml"
    assert main(["calibrate", str(dump), "-o", str(cost_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    costs = yaml.safe_load(cost_file.read_text())
    assert costs == report["cost_model"] and report["iterations"] == list(range(1, STEPS))
    assert report["step_time_error"] == max(abs(r["error"]) for r in report["per_rank"]) < float("inf")
    assert all(v > 0 for v in costs["compute"]["f"] + costs["compute"]["bw"])
    assert costs["host"]["send"] > 0 and costs["host"]["recv"] > 0, "postings take host time on a real run"
    # a real transfer takes time, or less than the clocks resolve, or no node waited for one (rarely, on a
    # loaded host: each said so)
    assert (costs["p2p"].get("intra_node", {}).get("latency", 0) > 0
            or any("taken as no latency" in note or "no p2p latency was measured" in note
                   for note in report["notes"])), report["notes"]

    assert main(["simulate", "-a", "all", "--pp", str(PP), "-m", str(M), "--cost", str(cost_file), "--json"]) == 0
    rows = {r["algorithm"]: r for r in json.loads(capsys.readouterr().out)["results"] if "error" not in r}
    assert {"1f1b", "zb-h1", "zbv", "interleaved-1f1b", "v-half"} <= set(rows)
    assert all(rows[a]["step_time"] > 0 and 0 <= rows[a]["bubble_rate"] < 1 for a in rows)
    # the file predicts 1F1B's own step as calibrate replayed it (same table, same model)
    assert rows["1f1b"]["step_time"] == pytest.approx(report["step_time"]["simulated"], rel=0.05)
