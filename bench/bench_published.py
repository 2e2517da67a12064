"""Projection accuracy against published, measured training runs.

    PYTHONPATH=. python bench/bench_published.py [--output bench/results/published.json] [--markdown FILE]

Projects every run of ``bench/data/published_runs.yaml`` (model, GPUs, TP/PP/CP/EP/VP, batch sizes,
precision, recompute as the source ran them; see :mod:`primuspipe.projection.published`) with the
shipped model and hardware files and the default efficiencies, and prints published vs projected
tokens/s per GPU, their ratio, the memory verdict and how long each projection took. The goal: every
ratio within 0.90-1.10, no OOM verdict, every projection under 10 s. Rows marked held out were not
looked at while the model's constants were chosen.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.projection.published import load_runs, project_run  # noqa: E402

RUNS = {run.id: run for run in load_runs()}
BEFORE = Path(__file__).resolve().parent / "results" / "published_before.json"
"""The projections of the same runs by the model before FP8, shapes and overlap were modelled (FP8 rows
run as BF16, unknown settings dropped), kept for the comparison."""


def produce() -> tuple[dict, str]:
    rows = [project_run(run) for run in RUNS.values()]
    done = [r for r in rows if "ratio" in r and not r["excluded"] and not r["lower_bound"]]
    bounds = [r for r in rows if "ratio" in r and r["lower_bound"]]
    summary = {
        "runs": len(rows), "counted": len(done), "excluded": sum(bool(r["excluded"]) for r in rows),
        "lower_bounds": len(bounds), "lower_bounds_reached": sum(r["ratio"] >= 0.9 for r in bounds),
        "within_10_percent": sum(0.9 <= r["ratio"] <= 1.1 for r in done),
        "within_15_percent": sum(0.85 <= r["ratio"] <= 1.15 for r in done),
        "oom_verdicts": sum(r["verdict"] == "OOM" for r in done),
        "worst_ratio": min(done, key=lambda r: -abs(r["ratio"] - 1))["ratio"] if done else None,
        "slowest_projection_s": max(r["seconds"] for r in rows),
    }
    before = {r["id"]: r for r in json.loads(BEFORE.read_text())} if BEFORE.is_file() else {}
    cells = [_cells(r, before.get(r["id"], {})) for r in rows]
    table = markdown_table(["run", "source", "GPUs", "layout", "precision", "published tok/s/GPU",
                            "before: projected (ratio, memory)", "now: projected", "ratio", "memory", "s"], cells)
    table += "\n" + ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()) + "\n"
    return {"summary": summary, "rows": rows}, table


def _cells(r: dict, before: dict) -> list[str]:
    run = RUNS[r["id"]]
    t = run.training
    layout = " ".join(f"{short}{t.get(field, 1)}" for short, field in (
        ("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"), ("CP", "context_parallel_size"),
        ("VP", "virtual_pipeline_model_parallel_size"), ("EP", "expert_model_parallel_size"),
        ("MBS", "micro_batch_size"), ("GBS", "global_batch_size")))
    precision = f"FP8 {t.get('fp8_recipe', 'delayed')}" if t.get("fp8_format") else "BF16"
    name = (r["id"] + (" (held out)" if r["held_out"] else "") + (" (excluded)" if r["excluded"] else "")
            + (" (lower bound)" if r["lower_bound"] else ""))
    published = f"{r.get('published_tokens_per_s_per_gpu', float('nan')):,.0f}"
    if "model_tflops_per_gpu" in run.published:
        published += f" (= {run.published['model_tflops_per_gpu']} TFLOP/s, {run.published['flops_convention']} attention)"
    was = (f"{before['projected_tokens_per_s_per_gpu']:,.0f} ({before['ratio']:.2f}, {before['verdict']})"
           if "ratio" in before else "refused" if before else "(row added later)")
    now = ([f"{r['projected_tokens_per_s_per_gpu']:,.0f}", f"{r['ratio']:.3f}", f"{r['verdict']} {r['peak_memory_gib']:.1f} GiB"]
           if "ratio" in r else ["-", "-", "refused: " + r["error"][:80]])
    return [name, f"[{run.source.split(',')[0]}]({run.url})", str(r["gpus"]), layout, precision, published, was, *now,
            f"{r['seconds']:.1f}"]


if __name__ == "__main__":
    run_bench(__doc__, "published", produce)
