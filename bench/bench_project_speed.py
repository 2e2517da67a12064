"""How long a whole ``primuspipe project`` takes, and what zb-auto does among the fixed algorithms.

    PYTHONPATH=. python bench/bench_project_speed.py [--output bench/results/project_speed.json] [--markdown FILE]

Runs the command as a user does (a subprocess, imports included, every registered algorithm, ``--json``)
on every shipped model file with its shipped training file (the built-in defaults where it has none) on
the H100 and the MI300X, and on every run of ``bench/data/published_runs.yaml`` with the run's settings;
then ``--search`` on two shipped pairs. Per projection it records the wall time, the command's CPU time
(what the wall time is on an idle host: on a shared one the wall time also counts other processes'
turns) and, from the ranked
rows: whether zb-auto's row is slower than the best fixed algorithm of its configuration that fits as
well, and whether a degenerate row (or an OOM one) is ranked above a working one. The goals: every
projection under 10 s, every ``--search`` under 60 s, no zb-auto row slower than the best fixed one, no
degenerate row above a working one.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.projection.published import EXAMPLES, load_runs, training_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEARCH_PAIRS = (("llama3-70b", "h100"), ("mixtral-8x7b", "h100"))
RANK = {"FITS": 0, "AT-RISK": 1, "OOM": 2}


def _project(model: Path, training: Path | None, hardware: str, *extra: str) -> tuple[float, float, dict]:
    command = [sys.executable, "-c", "import sys; from primuspipe.cli import main; sys.exit(main())", "project",
               "--model", str(model),
               "--hardware", str(EXAMPLES / "hardware" / f"{hardware}.yaml"), "--json", *extra]
    if training is not None:
        command += ["--training", str(training)]
    start, used = time.perf_counter(), _children_cpu()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    seconds, cpu = time.perf_counter() - start, _children_cpu() - used
    if done.returncode:
        return seconds, cpu, {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return seconds, cpu, json.loads(done.stdout)


def _children_cpu() -> float:
    """CPU seconds (user + system) of finished child processes: the projection's own work, which a shared
    host's load does not inflate as it does the wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _checks(results: list[dict]) -> dict:
    """zb-auto against the best fixed algorithm of its configuration; degenerate or OOM rows above working ones."""
    def config(r: dict) -> tuple:
        return r["pp"], r["micro_batch_size"], r["recompute"], r["data_parallel_size"]

    slower = []
    for auto in (r for r in results if r["algorithm"] == "zb-auto"):
        fixed = [r["step_time_s"] for r in results if r["algorithm"] != "zb-auto" and config(r) == config(auto)
                 and RANK[r["verdict"]] <= RANK[auto["verdict"]]]
        if fixed and auto["step_time_s"] > min(fixed) * (1 + 1e-9):
            slower.append(f"{auto['step_time_s']:.4f} s > {min(fixed):.4f} s")
    working = [k for k, r in enumerate(results) if r["verdict"] != "OOM" and not r.get("note", "").startswith("degenerate")]
    broken = [k for k, r in enumerate(results) if r["verdict"] == "OOM" or r.get("note", "").startswith("degenerate")]
    misranked = bool(working and broken and min(broken) < max(working))
    degenerate = sum(r.get("note", "").startswith("degenerate") for r in results)
    return {"zb_auto_slower": slower, "broken_above_working": misranked, "degenerate_rows": degenerate,
            "best": results[0]["algorithm"] if results else None}


def _row(name: str, seconds: float, cpu: float, out: dict, search: bool = False) -> dict:
    if "error" in out:
        return {"case": name, "search": search, "seconds": seconds, "cpu_s": cpu, "error": out["error"]}
    return {"case": name, "search": search, "seconds": seconds, "cpu_s": cpu, "rows": len(out["results"]),
            **_checks(out["results"])}


def produce() -> tuple[dict, str]:
    rows = []
    trainings = EXAMPLES / "training"
    for model in sorted((EXAMPLES / "models").glob("*.yaml")):
        training = trainings / model.name if (trainings / model.name).is_file() else None
        for hardware in ("h100", "mi300x"):
            rows.append(_row(f"{model.stem} on {hardware}", *_project(model, training, hardware)))
    with tempfile.TemporaryDirectory() as tmp:
        for run in load_runs():
            path = Path(tmp) / f"{run.id}.yaml"
            t = training_of(run)
            settings = dict(run.training) | {"data_parallel_size": t.data_parallel_size}
            path.write_text(yaml.safe_dump(settings))
            model = EXAMPLES / "models" / f"{run.model}.yaml"
            if run.seq_length is not None:  # the row's sequence length in a copy of the model file
                fields = yaml.safe_load(model.read_text()) | {"seq_length": run.seq_length}
                model = Path(tmp) / f"{run.id}.model.yaml"
                model.write_text(yaml.safe_dump(fields))
            rows.append(_row(f"published: {run.id}", *_project(model, path, run.hardware)))
    for model, hardware in SEARCH_PAIRS:
        training = trainings / f"{model}.yaml"
        rows.append(_row(f"{model} on {hardware} --search",
                         *_project(EXAMPLES / "models" / f"{model}.yaml", training, hardware, "--search"), search=True))
    plain = [r for r in rows if not r["search"] and "error" not in r]
    searched = [r for r in rows if r["search"] and "error" not in r]
    summary = {
        "projections": len(plain), "errors": [r["case"] + ": " + r["error"] for r in rows if "error" in r],
        "slowest_project_s": max(r["seconds"] for r in plain),
        "slowest_project_cpu_s": max(r["cpu_s"] for r in plain),
        "slowest_search_s": max((r["seconds"] for r in searched), default=None),
        "slowest_search_cpu_s": max((r["cpu_s"] for r in searched), default=None),
        "zb_auto_slower_than_best_fixed": sum(bool(r["zb_auto_slower"]) for r in plain + searched),
        "broken_ranked_above_working": sum(r["broken_above_working"] for r in plain + searched),
        "degenerate_rows": sum(r["degenerate_rows"] for r in plain + searched),
    }
    cells = [[r["case"], f"{r['seconds']:.1f}", f"{r['cpu_s']:.1f}", r.get("best") or "-", str(len(r.get("zb_auto_slower", []))),
              "yes" if r.get("broken_above_working") else "no", str(r.get("degenerate_rows", "-")), r.get("error", "")]
             for r in rows]
    table = markdown_table(["case", "wall s", "CPU s", "ranked first", "zb-auto slower than best fixed", "broken above working",
                            "degenerate rows", "error"], cells)
    table += "\n" + ", ".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()) + "\n"
    return {"summary": summary, "rows": rows}, table


if __name__ == "__main__":
    run_bench(__doc__, "project_speed", produce)
