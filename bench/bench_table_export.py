"""Export and validation time of large tables against their node count, per format.

The issue's case: ``primuspipe export 1f1b --pp 32 -m 512 --format csv`` (about 390,000 nodes with
communication) took 18 s where JSON took 0.4 s -- the resource plan torch's CSV needs (where each stage
is unsharded, resharded and reduced) rescanned the rest of a rank's row for every node, quadratic in
its length. Per shape and format this times, in process and best of 3: building the text of the table
(``dump_table``, what ``export`` writes), and reading that text back and validating it (``validate``:
``load_table`` + ``validate``). Near-linear means the seconds per node stay about flat as the table grows.
Writes JSON (default bench/results/table_export.json) and a markdown table::

    python bench/bench_table_export.py [--output PATH] [--markdown PATH]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.algorithms.build import build_schedule
from primuspipe.io.formats import dump_table, load_table
from primuspipe.passes.validation import validate

SHAPES = ((8, 128), (16, 256), (32, 512))
"""(pp, microbatches) of 1F1B tables: 4x the nodes at each step, the last the issue's 390k-node table."""
FORMATS = ("json", "csv", "primus")


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def produce() -> tuple[dict, str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp, m in SHAPES:
            table = build_schedule("1f1b", pp=pp, microbatches=m)
            nodes = sum(map(len, table.ranks))
            for fmt in FORMATS:
                path = Path(tmp) / f"t.{'txt' if fmt == 'primus' else fmt}"
                export_s = _best(lambda: dump_table(table, fmt))
                path.write_text(dump_table(table, fmt))
                validate_s = _best(lambda: validate(load_table(path)))
                rows.append({"pp": pp, "microbatches": m, "nodes": nodes, "format": fmt, "export_s": export_s,
                             "validate_s": validate_s, "export_us_per_node": 1e6 * export_s / nodes,
                             "validate_us_per_node": 1e6 * validate_s / nodes})
    largest = [r for r in rows if (r["pp"], r["microbatches"]) == SHAPES[-1]]
    growth = {fmt: {what: max(r[what] for r in rows if r["format"] == fmt) /
                    min(r[what] for r in rows if r["format"] == fmt)
                    for what in ("export_us_per_node", "validate_us_per_node")} for fmt in FORMATS}
    payload = {"results": rows, "largest": largest,
               "per_node_growth": growth,
               "note": "per_node_growth: the largest over the smallest seconds per node across the shapes "
                       "(1 = linear; the quadratic CSV export grew by the node ratio, 64x here)"}
    table = markdown_table(["pp", "m", "nodes", "format", "export s", "validate s", "export us/node", "validate us/node"],
                           [[str(r["pp"]), str(r["microbatches"]), f"{r['nodes']:,}", r["format"], f"{r['export_s']:.3f}",
                             f"{r['validate_s']:.3f}", f"{r['export_us_per_node']:.2f}",
                             f"{r['validate_us_per_node']:.2f}"] for r in rows])
    return payload, table


if __name__ == "__main__":
    run_bench(__doc__, "table_export", produce)
