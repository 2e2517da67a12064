#!/usr/bin/env bash
# The main job, end to end on a built-in default (no GPU needed):
#   1. build a zero-bubble schedule table (ZBV) and prove it valid;
#   2. train a tiny megatron-core GPT with it for real (4 pipeline ranks on CPU/gloo, split
#      input-grad/weight-grad backward), checked against Megatron's own schedule on the same weights
#      and data, dumping every node's timing (dump_pp_data);
#   3. calibrate a cost model from that dump, simulate every algorithm with it and rank them;
#   4. draw the real run beside its simulation (PNG, interactive HTML, Perfetto trace): how far the
#      cost model is from the measured timeline, node by node.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
out=${PRIMUSPIPE_DEMO_DIR:-out/demo}
rm -rf "$out" && mkdir -p "$out"
PP=4 M=8 ALGO=zbv

echo "== 1. $ALGO for pp=$PP, $M microbatches: build, validate, show"
primuspipe export $ALGO --pp $PP -m $M --format json -o "$out/$ALGO.json"
primuspipe validate "$out/$ALGO.json"
primuspipe show $ALGO --pp $PP -m $M --compute-only

echo "== 2. train with it: torchrun, $PP processes on CPU (gloo), against Megatron's own schedule"
torchrun --nproc-per-node $PP examples/train_gpt.py --pp $PP --microbatches $M --pp-algorithm $ALGO \
    --iterations 4 --compare-native --dump-dir "$out/pp_data" 2>"$out/train.log" \
  | tail -n 1 | tee "$out/train.json"
python - "$out/train.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["max_abs_grad_diff"] <= 1e-6 and abs(r["loss"] - r["native_loss"]) <= 1e-6, r
print(f"   loss {r['loss']:.6f} = Megatron's {r['native_loss']:.6f}; max |grad diff| {r['max_abs_grad_diff']:g}; "
      f"step {r['step_time_s'] * 1e3:.1f} ms vs Megatron's 1F1B-family schedule {r['native_step_time_s'] * 1e3:.1f} ms")
PY
echo "   per-rank timelines of every iteration: $out/pp_data"

echo "== 3. calibrate a cost model from the run, simulate every algorithm with it, rank them"
primuspipe -q calibrate "$out/pp_data" -o "$out/measured_cost.yaml"
primuspipe simulate --algorithm all --pp $PP -m $M --cost "$out/measured_cost.yaml" -o "$out/sim"

echo "== 4. the real run beside the simulation of its own node order under the measured costs"
primuspipe vis "$out/pp_data" --cost "$out/measured_cost.yaml" \
    --png "$out/$ALGO-run-vs-sim.png" --html "$out/$ALGO-run-vs-sim.html" --trace "$out/$ALGO-run.trace.json"
echo "   open $out/$ALGO-run-vs-sim.png, $out/$ALGO-run-vs-sim.html, or load $out/$ALGO-run.trace.json in ui.perfetto.dev"
