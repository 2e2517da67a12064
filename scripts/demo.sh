#!/usr/bin/env bash
# The main job, end to end on a built-in default: set up, build a schedule, validate it and show it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
out=${PRIMUSPIPE_DEMO_DIR:-out/demo}
mkdir -p "$out"

echo "== 1. the registered algorithms"
primuspipe list

echo "== 2. build interleaved 1F1B for pp=4, vpp=2, 8 microbatches; export, validate, show"
primuspipe export interleaved-1f1b --pp 4 --vpp 2 -m 8 --format json -o "$out/interleaved-1f1b.json"
primuspipe export interleaved-1f1b --pp 4 --vpp 2 -m 8 --format csv -o "$out/interleaved-1f1b.csv"
primuspipe validate "$out/interleaved-1f1b.json"
primuspipe show interleaved-1f1b --pp 4 --vpp 2 -m 8 --compute-only
