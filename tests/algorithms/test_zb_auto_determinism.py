"""zb-auto is bounded by work, not by the clock: two processes, one of them competing with busy
processes for the CPU, build bitwise-identical tables (and reports), MILP included."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import primuspipe

SEARCH = textwrap.dedent("""
    import hashlib, json
    from dataclasses import asdict
    from primuspipe.algorithms import ScheduleRequest
    from primuspipe.ir.cost_model import CostModel
    from primuspipe.search.zb_auto import zb_auto_search
    out = []
    for pp, vpp, m, limit, placement in ((4, None, 8, 3, None), (4, 1, 8, 3, "interleaved")):
        req = ScheduleRequest(pp, vpp, m, CostModel.per_stage(pp, 1, 1.5, 0.5), memory_limit=limit)
        table, report = zb_auto_search(req, placement=placement)
        out.append([hashlib.sha256(table.to_json().encode()).hexdigest(), asdict(report)])
    print(json.dumps(out))
""")

ENV = {**os.environ, "PYTHONPATH": str(Path(primuspipe.__file__).parents[1])}  # this checkout's primuspipe

BURN = "import time\nend = time.time() + 120\nwhile time.time() < end: pass\n"


@pytest.mark.slow
def test_two_processes_one_under_load_build_identical_tables():
    quiet = subprocess.run([sys.executable, "-c", SEARCH], capture_output=True, text=True, check=True, env=ENV).stdout
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(3)]
    try:
        loaded = subprocess.run([sys.executable, "-c", SEARCH], capture_output=True, text=True, check=True,
                                env=ENV).stdout
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert quiet == loaded
    reports = [report for _, report in json.loads(quiet)]
    assert any(r["lower_bound"] is not None for r in reports), "the MILP ran in at least one of the searches"
