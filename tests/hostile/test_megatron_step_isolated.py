"""The in-process Megatron step cases (test_megatron_step_arguments.py) in an interpreter of their own: Megatron's
parallel state makes gloo subgroups whose threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) outlive
``destroy_process_group``, so the pytest process that ran them could no longer fork working gloo ranks -- the
Megatron tests launched after them hung at their first collective. Their tally joins this sweep's."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostile_support import KINDS, record

CASES = Path(__file__).with_name("test_megatron_step_arguments.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_the_megatron_step_cases_in_an_interpreter_of_their_own(tmp_path):
    tally = tmp_path / "tally.json"
    env = {**os.environ, "PRIMUSPIPE_HOSTILE_OWN_INTERPRETER": "1", "HOSTILE_TALLY_JSON": str(tally)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    counts = json.loads(tally.read_text())
    assert counts["inputs"] > 0, done.stdout[-2000:]
    for kind in KINDS:
        for k in range(counts[kind]):
            record(kind, f"megatron step case {k} ({kind})")
