#!/usr/bin/env bash
# The main job, end to end on a built-in default (no GPU needed):
#   1. build and validate a schedule table;
#   2. train a tiny megatron-core GPT with it for real (4 pipeline ranks, CPU/gloo), checked against
#      Megatron's own schedule on the same weights and data, dumping per-node timings;
#   3. simulate every algorithm for the same shape and rank them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
out=${PRIMUSPIPE_DEMO_DIR:-out/demo}
rm -rf "$out" && mkdir -p "$out"
PP=4 VPP=2 M=8 ALGO=interleaved-1f1b

echo "== 1. $ALGO for pp=$PP vpp=$VPP microbatches=$M: build, validate, show"
primuspipe export $ALGO --pp $PP --vpp $VPP -m $M --format json -o "$out/$ALGO.json"
primuspipe validate "$out/$ALGO.json"
primuspipe show $ALGO --pp $PP --vpp $VPP -m $M --compute-only

echo "== 2. train with it: torchrun, $PP processes on CPU (gloo), compared with Megatron's own schedule"
torchrun --nproc-per-node $PP examples/train_gpt.py --pp $PP --vpp $VPP --microbatches $M \
    --pp-algorithm $ALGO --iterations 3 --compare-native --dump-dir "$out/pp_data" 2>"$out/train.log" \
  | tail -n 1 | tee "$out/train.json"
python - "$out/train.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["max_abs_grad_diff"] <= 1e-6 and abs(r["loss"] - r["native_loss"]) <= 1e-6, r
print(f"   loss {r['loss']:.6f} = Megatron's {r['native_loss']:.6f}; max |grad diff| {r['max_abs_grad_diff']:g}; "
      f"step {r['step_time_s'] * 1e3:.1f} ms vs Megatron {r['native_step_time_s'] * 1e3:.1f} ms")
PY
echo "   per-rank timelines of every iteration: $out/pp_data"

echo "== 3. simulate every algorithm for pp=$PP, $M microbatches (F=B=W=1 per 1F1B stage) and rank them"
primuspipe simulate --algorithm all --pp $PP -m $M -o "$out/sim"
echo "   timelines and Perfetto traces: $out/sim"
