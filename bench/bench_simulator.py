"""Simulator speed: how long ``simulate`` takes on large tables (table building is timed apart), and
the whole command a user types.

Targets, pp=64, vpp=2, m=512 (interleaved-1f1b, ~390k nodes with communication) on a 2-core CI
machine: ``simulate`` under 2 s; ``primuspipe simulate -a interleaved-1f1b --pp 64 --vpp 2 -m 512``
-- start-up, building the table, adding communication, validating, simulating, printing -- under 3 s.
Writes JSON (default bench/results/simulator.json)::

    python bench/bench_simulator.py [--output PATH] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, simulate

HEADLINE = ("interleaved-1f1b", 64, 2, 512)
SWEEP = [(algorithm, pp, vpp, m) for algorithm, vpp in (("1f1b", 1), ("interleaved-1f1b", 2))
         for pp in (4, 8, 16, 32) for m in (pp, 4 * pp)]


def measure(algorithm: str, pp: int, vpp: int, m: int, repeat: int) -> dict:
    start = time.perf_counter()
    table = build_schedule(algorithm, pp, m, vpp)
    build_s = time.perf_counter() - start
    cost = CostModel.per_stage(pp * vpp, 1.0, 1.0, 1.0)
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = simulate(table, cost)
        times.append(time.perf_counter() - start)
    return {"algorithm": algorithm, "pp": pp, "vpp": vpp, "microbatches": m,
            "nodes": sum(len(row) for row in table.ranks), "build_s": round(build_s, 4),
            "simulate_s_min": round(min(times), 4), "simulate_s_median": round(statistics.median(times), 4),
            "bubble_rate": result.bubble_rate}


def whole_command(repeat: int) -> dict:
    """Wall time of the ``primuspipe simulate`` command for the headline case, in a fresh process."""
    algorithm, pp, vpp, m = HEADLINE
    argv = ["simulate", "-a", algorithm, "--pp", str(pp), "--vpp", str(vpp), "-m", str(m)]
    code = f"import sys; from primuspipe.cli import main; sys.exit(main({argv!r}))"
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return {"command": "primuspipe " + " ".join(argv), "seconds_min": round(min(times), 3),
            "seconds_median": round(statistics.median(times), 3), "meets_target": statistics.median(times) < 3.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", "-o", type=Path, default=Path(__file__).parent / "results" / "simulator.json",
                        help="where to write the JSON results")
    parser.add_argument("--repeat", type=int, default=3,
                        help="simulate each table this many times (min and median kept)")
    args = parser.parse_args()
    headline = measure(*HEADLINE, args.repeat)
    report = {
        "benchmark": "simulator", "python": platform.python_version(), "machine": platform.machine(),
        "target": {"case": "interleaved-1f1b pp=64 vpp=2 m=512", "simulate_s": 2.0, "whole_command_s": 3.0},
        "headline": {**headline, "meets_target": headline["simulate_s_median"] < 2.0},
        "whole_command": whole_command(args.repeat),
        "sweep": [measure(*case, args.repeat) for case in SWEEP],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["headline"]))
    print(json.dumps(report["whole_command"]))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
