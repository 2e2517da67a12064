"""The NCCL matrix on real GPUs (needs at least two: NCCL refuses two ranks on one device).

Every shipped algorithm through ``examples/train_gpt.py --compare-native`` under torchrun on NCCL: it
must finish (each run has a deadline) with the gradients of Megatron's own schedule. The CPU
emulator's verdicts (tests/runtime/test_nccl_emulation.py) are what these runs confirm on the real
transport; ``bench/gpu_suite.sh`` runs this file with the rest of the GPU-only measurements.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primuspipe.algorithms.registry import list_algorithms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason="needs at least two CUDA devices (NCCL p2p between ranks)")]
ROOT = Path(__file__).resolve().parents[2]


def _torchrun(pp: int, *flags: str) -> dict:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(pp), "examples/train_gpt.py",
                           "--pp", str(pp), *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("algorithm", [info.name for info in list_algorithms()])
@pytest.mark.parametrize("pp", [p for p in (2, 4) if p <= max(2, torch.cuda.device_count())])
def test_every_algorithm_runs_on_real_nccl_and_matches_megatron(algorithm, pp):
    result = _torchrun(pp, "--microbatches", str(2 * pp + 1), "--pp-algorithm", algorithm,
                       "--num-layers", str(4 * pp), "--iterations", "2", "--compare-native")
    assert result["device"].startswith("cuda")
    assert result["max_abs_grad_diff"] <= 1e-5, result
