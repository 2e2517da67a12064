"""examples/train_torch.py runs under torchrun as documented: its gradients equal torch's runtime on the
same table, the loss goes down, and a CSV torch's own ZBV schedule wrote trains the same way."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primuspipe.testing.torch_pipelining import torch_orders
from emulation_limits import TORCH_RUNTIME_HANGS

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "train_torch.py"), "--pp", "2", "--iterations", "3", "--hidden", "16",
                           "--compare-torch", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@TORCH_RUNTIME_HANGS
@pytest.mark.slow
def test_example_trains_like_torch(tmp_path):
    result = _run("--microbatches", "4", "--algorithm", "dualpipe-v")
    assert result["max_abs_grad_diff_vs_torch"] == 0.0
    assert result["losses"][-1] < result["losses"][0]
    path = tmp_path / "torch_zbv.csv"
    path.write_text(torch_orders("ScheduleZBVZeroBubble", 2, 2, 4)[0])
    from_csv = _run("--schedule", str(path))
    assert (from_csv["algorithm"], from_csv["microbatches"], from_csv["max_abs_grad_diff_vs_torch"]) == ("torch_zbv", 4, 0.0)
