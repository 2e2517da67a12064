#!/usr/bin/env bash
# Runs the Transformer Engine deferral checks that need a GPU (tests/megatron/test_te_gpu.py) and records
# what ran where: the GPU, the TE / torch / megatron-core versions, and every test's outcome, as JSON.
#
#   bench/gpu_te.sh [RESULT_DIR]     (default: bench/results/gpu_te; $OUT if set, for lent GPU machines)
#
# Needs: a CUDA GPU, torch with CUDA, transformer_engine >= 2.3 and megatron-core importable by $PYTHON
# (default: python3). Exits 0 only if every test passed; skips (no FP8 on this GPU) are listed, not failures.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DIR=${1:-${OUT:-bench/results}/gpu_te}
mkdir -p "$DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" - "$DIR/environment.json" <<'PY'
import json, sys, importlib.metadata as md
import torch
env = {"cuda": torch.cuda.is_available(), "torch": torch.__version__,
       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
       "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None}
for dist in ("transformer_engine", "transformer-engine", "megatron-core"):
    try:
        env[dist] = md.version(dist)
    except md.PackageNotFoundError:
        env.setdefault(dist, None)
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env))
if not env["cuda"]:
    sys.exit("gpu_te.sh: no CUDA device; nothing here can run (the CPU contract tests are tests/megatron/test_te_*.py)")
PY

status=0
"$PYTHON" -m pytest -q -p no:cacheprovider -rA tests/megatron/test_te_gpu.py --junitxml="$DIR/junit.xml" \
    2>&1 | tee "$DIR/pytest.log" || status=$?

"$PYTHON" - "$DIR" <<'PY'
import json, sys, xml.etree.ElementTree as ET
d = sys.argv[1]
cases = []
for case in ET.parse(f"{d}/junit.xml").getroot().iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "failed"}.get(tag, tag)
            cases.append({"test": case.get("name"), "outcome": outcome, "why": (node.get("message") or "")[:300]})
            break
    else:
        cases.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0))})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
result = {"environment": json.load(open(f"{d}/environment.json")), "counts": counts, "tests": cases}
json.dump(result, open(f"{d}/gpu_te.json", "w"), indent=1)
print(json.dumps(counts))
PY
exit $status
