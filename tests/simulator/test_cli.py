"""``primuspipe simulate``."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from simulator_support import simulate_rows

from primuspipe.algorithms import list_algorithms
from primuspipe.cli import main
from primuspipe.io.timeline import Timeline

KEYS = {"algorithm", "pp", "vpp", "placement", "microbatches", "step_time", "bubble_rate", "bubble_rate_mean",
        "bubble_rate_span", "peak_activations", "peak_memory_bytes", "w_retained_fraction", "fits"}
CONSTRUCTED = {"zb-h1", "zb-h2", "zbv", "v-half", "v-min"}
"""The algorithms that choose among constructions and say which (their rows carry "construction")."""


def test_all_algorithms_json_schema_ranking_and_refusals(capsys):
    rows = simulate_rows(capsys, "--algorithm", "all", "--pp", "3", "-m", "4", "--memory-limit", "2")
    assert {r["algorithm"] for r in rows} == {info.name for info in list_algorithms()}  # nothing dropped
    simulated = [r for r in rows if "error" not in r]
    refused = [r for r in rows if "error" in r]
    for r in simulated:
        search = r.get("search", {})  # zb-auto's table keeps the construction of the algorithm it came from
        origin = search["source"] if search.get("method") == "fixed" else r["algorithm"]
        constructed = {"construction"} if origin in CONSTRUCTED else set()
        assert set(r) == KEYS | ({"search"} if r["algorithm"] == "zb-auto" else set()) | constructed
        assert len(r["peak_activations"]) == 3 and r["fits"] == (max(r["peak_activations"]) <= 2)
        assert r["bubble_rate"] + 1e-12 >= r["bubble_rate_mean"] >= 0
    assert [r["step_time"] for r in simulated] == sorted(r["step_time"] for r in simulated)
    one_f_one_b = next(r for r in simulated if r["algorithm"] == "1f1b")
    assert one_f_one_b["bubble_rate"] == pytest.approx(2 / 6) and not one_f_one_b["fits"]  # holds 3 on rank 0
    # dualpipe-v (vpp 2) refuses fewer than 2 pp microbatches: listed with its reason, after every
    # simulated row (interleaved-1f1b builds every m: it picks a group size that leaves no short last group)
    dualpipe = next(r for r in refused if r["algorithm"] == "dualpipe-v")
    assert "at least 2*pp = 6 microbatches" in dualpipe["error"] and dualpipe["vpp"] == 2
    assert "interleaved-1f1b" in {r["algorithm"] for r in simulated}
    assert rows[-len(refused):] == refused


def test_given_vpp_applies_to_every_algorithm(capsys):
    rows = {r["algorithm"]: r for r in simulate_rows(capsys, "-a", "all", "--pp", "2", "--vpp", "2", "-m", "4")}
    assert "needs vpp = 1" in rows["1f1b"]["error"]
    assert rows["interleaved-1f1b"]["bubble_rate"] == pytest.approx(1 / (2 * 4 + 1))
    # a chunk costs half a 1F1B stage, so the step compares with 1f1b's (4 + 1) * 3
    assert rows["interleaved-1f1b"]["step_time"] == pytest.approx((2 * 4 + 1) * 1.5)


def test_per_stage_flags_and_p2p(capsys):
    [row] = simulate_rows(capsys, "-a", "1f1b", "--pp", "2", "-m", "2", "--f", "1,2", "--b", "2,4", "--w", "0")
    assert row["step_time"] == 15  # the hand-computed critical path in test_golden
    [row] = simulate_rows(capsys, "-a", "1f1b", "--pp", "2", "-m", "2", "--p2p", "0.5")
    assert row["step_time"] == 10  # test_engine's exact event log


def test_cost_file_and_output_dir(capsys, tmp_path):
    cost = tmp_path / "cost.yaml"
    cost.write_text("compute: {f: 1, b: 1, w: 1}\nmemory: {activation_bytes: 1.0e9, w_retained_fraction: 0.5, "
                    "parameter_bytes: 2.0e9}\n")
    out = tmp_path / "out"
    [row] = simulate_rows(capsys, "-a", "1f1b", "--pp", "4", "-m", "8", "--cost", str(cost), "-o", str(out))
    assert row["peak_memory_bytes"] == 2e9 + 4e9
    assert Timeline.load(out / "1f1b.timeline.json").step_time == row["step_time"]
    assert json.loads((out / "1f1b.trace.json").read_text())["traceEvents"]


def test_rich_table_marks_algorithms_over_the_limit_and_lists_refusals(capsys):
    assert main(["simulate", "-a", "all", "--pp", "3", "-m", "4", "--memory-limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "1f1b" in out and "OVER" in out
    assert "not simulated: dualpipe-v (vpp=2)" in out


def test_single_refused_algorithm_fails_with_one_error_line_even_with_json(capsys):
    assert main(["simulate", "-a", "1f1b", "--pp", "4", "--vpp", "2", "-m", "8", "--json"]) == 1
    captured = capsys.readouterr()
    [line] = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert "needs vpp = 1" in line and not captured.out


@pytest.mark.parametrize("argv,message", [
    (["--cost", "x.yaml", "--f", "2"], "either in --cost"),
    (["--f", "1,2,3"], "give one number or 4"),
    (["-a", "nope"], "no algorithm named 'nope'"),
])
def test_user_mistakes(capsys, argv, message):
    base = {"-a": "1f1b", "--pp": "4", "-m": "8"}
    args = ["simulate"] + [x for k, v in base.items() if k not in argv for x in (k, v)] + argv
    status = main(args)
    captured = capsys.readouterr()
    assert message in captured.err + captured.out
    assert status == 1 or "error" in captured.out


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--algorithm", "--pp", "--vpp", "--microbatches", "--cost", "--f", "--b", "--w", "--bw", "--p2p",
                 "--memory-limit", "--output-dir", "--json"):
        assert flag in text


def test_installed_console_script():
    script = shutil.which("primuspipe") or str(Path(sys.executable).parent / "primuspipe")
    proc = subprocess.run([script, "simulate", "-a", "1f1b", "--pp", "8", "-m", "32", "--json"],
                          capture_output=True, text=True, timeout=120, check=True)
    [row] = json.loads(proc.stdout)["results"]
    assert round(row["bubble_rate"], 4) == 0.1795


def test_plan_cost_times_the_table_a_run_planned_with_other_costs(capsys, tmp_path):
    """--plan-cost unit: a cost-aware algorithm's table is planned as a runner given no costs plans it
    (build_schedule's unit costs), then timed under --cost; a file plans with that file. Under costs
    where B is three times F, v-half's two plans differ, and each row is exactly its table's simulation."""
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.simulator import CostModel, simulate

    cost_file = tmp_path / "cost.yaml"
    cost_file.write_text("compute: {f: [1.0, 1.4], b: [3.0, 3.2], w: [0.5, 0.6]}\n")
    cost = CostModel.load(cost_file, pp=2, vpp=2)
    argv = ["-a", "v-half", "--pp", "2", "-m", "8", "--cost", str(cost_file)]
    own, unit, planned = (simulate_rows(capsys, *argv, *extra)[0]["step_time"]
                          for extra in ([], ["--plan-cost", "unit"], ["--plan-cost", str(cost_file)]))
    assert own == planned == simulate(build_schedule("v-half", 2, 8, cost=cost), cost).step_time
    assert unit == simulate(build_schedule("v-half", 2, 8), cost).step_time
    assert unit != own, "the unit plan is another table"
    assert main(["simulate", *argv, "--plan-cost", str(tmp_path / "missing.yaml")]) == 1
    captured = capsys.readouterr()
    assert "missing.yaml" in captured.err + captured.out


def test_memory_limit_bytes_budgets_the_bytes_the_simulator_counts(capsys, tmp_path):
    # a split B's rise and what W keeps beyond the stage's activations count in bytes: zb-auto keeps within the
    # limit by that count, ZB-H1 (1F1B's microbatches, each held at 1.8x from B until W) is marked over it
    cost = tmp_path / "cost.yaml"
    cost.write_text("compute: {f: 1, b: 1.2, w: 0.8}\nmemory: {activation_bytes: 1.0e9, w_retained_fraction: 1.0, "
                    "w_excess_fraction: 0.8, b_rise_fraction: 0.84}\n")
    rows = {r["algorithm"]: r for r in simulate_rows(capsys, "-a", "all", "--pp", "4", "-m", "8", "--cost", str(cost),
                                                         "--memory-limit-bytes", "5.5e9")}
    assert rows["zb-h1"]["peak_memory_bytes"] > 5.5e9 and not rows["zb-h1"]["fits"]
    assert rows["zb-auto"]["peak_memory_bytes"] <= 5.5e9 and rows["zb-auto"]["fits"]
    assert main(["simulate", "-a", "zb-auto", "--pp", "4", "-m", "8", "--memory-limit-bytes", "5e9"]) == 1
    assert "add memory.activation_bytes" in capsys.readouterr().err


def test_a_command_runs_without_full_collections_and_restores_the_collector(capsys):
    """The command's large immutable table would be walked by every full collection for nothing; the young
    generations still run, and the caller's setting comes back (``main`` runs in-process here)."""
    import gc

    generations = []

    def seen(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    before = gc.get_threshold()
    gc.set_threshold(700, 1, 1)  # a full collection at every other middle one, were the command to keep it
    gc.callbacks.append(seen)
    try:
        assert main(["simulate", "-a", "interleaved-1f1b", "--pp", "8", "--vpp", "2", "-m", "64", "--json"]) == 0
        assert gc.get_threshold() == (700, 1, 1)
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*before)
    capsys.readouterr()
    assert generations.count(0) > 0, "young collections still run"
    assert 2 not in generations


def test_simulate_o_is_a_directory_and_refuses_a_file_name(capsys, tmp_path):
    """simulate -o keeps its meaning (--output-dir, as scripts use it); a new name like export's -o file is
    refused instead of becoming a directory of that name, and an existing directory of any name is taken."""
    argv = ["simulate", "-a", "1f1b", "--pp", "2", "-m", "2", "-o"]
    assert main([*argv, str(tmp_path / "sim.json")]) == 1
    assert "--json >" in capsys.readouterr().err and not (tmp_path / "sim.json").exists()
    (tmp_path / "odd.json").mkdir()
    for name in ("sim", "odd.json"):
        assert main([*argv, str(tmp_path / name)]) == 0
        assert (tmp_path / name / "1f1b.timeline.json").is_file()
