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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.projection.published import load_runs, project_run  # noqa: E402


def produce() -> tuple[dict, str]:
    rows = [project_run(run) for run in load_runs()]
    done = [r for r in rows if "ratio" in r and not r["excluded"]]
    summary = {
        "runs": len(rows), "counted": len(done), "excluded": sum(bool(r["excluded"]) for r in rows),
        "within_10_percent": sum(0.9 <= r["ratio"] <= 1.1 for r in done),
        "within_15_percent": sum(0.85 <= r["ratio"] <= 1.15 for r in done),
        "oom_verdicts": sum(r["verdict"] == "OOM" for r in done),
        "worst_ratio": min(done, key=lambda r: -abs(r["ratio"] - 1))["ratio"] if done else None,
        "slowest_projection_s": max(r["seconds"] for r in rows),
    }
    cells = []
    for r in rows:
        if "ratio" in r:
            cells.append([r["id"] + (" (held out)" if r["held_out"] else "") + (" (excluded)" if r["excluded"] else ""), f"{r['published_tokens_per_s_per_gpu']:,.0f}",
                          f"{r['projected_tokens_per_s_per_gpu']:,.0f}", f"{r['ratio']:.3f}",
                          f"{r['verdict']} {r['peak_memory_gib']:.1f}/{r['hbm_gib']:.0f} GiB", f"{r['seconds']:.1f}"])
        else:
            cells.append([r["id"], f"{r.get('published_tokens_per_s_per_gpu', float('nan')):,.0f}", "-", "-",
                          "refused: " + r["error"][:90], f"{r['seconds']:.1f}"])
    table = markdown_table(["run", "published tok/s/GPU", "projected", "ratio", "memory", "s"], cells)
    table += "\n" + ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()) + "\n"
    return {"summary": summary, "rows": rows}, table


if __name__ == "__main__":
    run_bench(__doc__, "published", produce)
