"""Validation time against table size: ``primuspipe validate`` on a compute-only torch CSV.

The issue's case is a compute-only pp=2 CSV with 10,000 microbatches (about 275 KB), which once ran
past 300 s (a rescan of the whole table per node). ``validate`` reads it, validates it as is, adds
communication and validates that too -- all timed, best of 3, per size, in process. Target: the
10,000-microbatch table in under 2 s. Writes JSON (default bench/results/validation.json) and a
markdown table (stdout or --markdown)::

    python bench/bench_validation.py [--output PATH] [--markdown PATH]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.algorithms.build import build_schedule
from primuspipe.io.formats import load_table, save_table
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import validate

SIZES = (1_000, 2_500, 5_000, 10_000, 20_000)
TARGET_S = 2.0
"""The issue's bound for pp=2 with 10,000 microbatches."""


def _validate_file(path: Path) -> int:
    table = load_table(path)  # a fresh object each time: nothing is cached between runs
    validate(table)
    full = validate(add_communication(table))
    return sum(len(row) for row in full.ranks)


def produce() -> tuple[dict, str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in SIZES:
            path = Path(tmp) / f"pp2_m{m}.csv"
            save_table(build_schedule("1f1b", pp=2, microbatches=m, communication=False), path, compute_only=True)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                nodes = _validate_file(path)
                times.append(time.perf_counter() - start)
            rows.append({"pp": 2, "microbatches": m, "csv_bytes": path.stat().st_size, "nodes_with_communication": nodes,
                         "seconds": min(times)})
    issue = next(r for r in rows if r["microbatches"] == 10_000)
    payload = {"target_s": TARGET_S, "meets_target": issue["seconds"] < TARGET_S, "results": rows}
    table = markdown_table(["pp", "microbatches", "CSV KB", "nodes (with comm.)", "validate s"],
                           [[str(r["pp"]), f"{r['microbatches']:,}", f"{r['csv_bytes'] / 1024:.0f}",
                             f"{r['nodes_with_communication']:,}", f"{r['seconds']:.3f}"] for r in rows])
    return payload, table


if __name__ == "__main__":
    run_bench(__doc__, "validation", produce)
