#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned development environment. Idempotent; safe to rerun.
# torch is installed first and explicitly as the CPU build: an unpinned `torch` requirement would pull
# several GB of CUDA packages. megatron-core 0.19 declares Python >= 3.12 but ships a wheel that runs on
# 3.11, hence --ignore-requires-python; numpy is capped so pip never tries a source build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.primuspipe-setup
want=$(cat requirements-dev.txt setup.py scripts/setup_env.sh | sha1sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
log=.venv/setup.log
: > "$log"
# pip's own chatter goes to the log; on failure the log is shown.
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" >>"$log" 2>&1 || { cat "$log"; echo "[setup] failed: pip $*" >&2; exit 1; }; }
echo "[setup] installing torch==2.13.0 (CPU build)"
pip install "torch==2.13.0"
echo "[setup] installing megatron-core==0.19.2"
pip install --ignore-requires-python "megatron-core==0.19.2" "numpy<2.5"
echo "[setup] installing test requirements and primuspipe (editable)"
pip install -r requirements-dev.txt
pip install --no-build-isolation -e .
echo "$want" > "$stamp"
echo "[setup] done"
