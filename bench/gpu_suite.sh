#!/usr/bin/env bash
# Everything in primuspipe that only a GPU machine can measure, in one run. Needs CUDA; the NCCL parts
# need at least two GPUs (NCCL refuses two ranks on one device) and are skipped with fewer.
#   bash bench/gpu_suite.sh [OUT_DIR]          (default out/gpu_suite; one JSON/log per part)
# Parts:
#   1. gpu-marked tests (NCCL matrix, offload, recorder, Transformer Engine where installed)
#   2. runner vs Megatron native: step time of primuspipe's 1f1b/interleaved/zb-h1/zbv vs Megatron's own
#   3. watchdog and dump overhead: the same run with the watchdog off (timeout 0), on, and dumping
#   4. split-W speed: F, B and W node times of part 3's dumped zbv run (calibrate), B + W against
#      part 2's 1f1b BW through the same runner
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu_suite}
mkdir -p "$out"
py=${PYTHON:-python}
gpus=$($py -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus" | tee "$out/summary.txt"
$py -c "import torch, json; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))" > "$out/environment.json"

echo "== 1. gpu-marked tests" | tee -a "$out/summary.txt"
$py -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | tail -n 3 | tee -a "$out/summary.txt"

run() {  # run NAME PP FLAGS... -> the example's JSON line in $out/NAME.json
  local name=$1 pp=$2; shift 2
  torchrun --standalone --nproc-per-node "$pp" examples/train_gpt.py --pp "$pp" "$@" \
    2>"$out/$name.log" | tail -n 1 > "$out/$name.json" && echo "   $name: $(cat "$out/$name.json")" | tee -a "$out/summary.txt"
}
if [ "$gpus" -ge 2 ]; then
  pp=$([ "$gpus" -ge 4 ] && echo 4 || echo 2)
  echo "== 2. runner vs Megatron native (pp=$pp)" | tee -a "$out/summary.txt"
  for algo in 1f1b interleaved-1f1b zb-h1 zbv; do
    run "native_vs_$algo" "$pp" --microbatches $((4 * pp)) --pp-algorithm "$algo" --num-layers $((4 * pp)) \
      --hidden-size 1024 --iterations 8 --compare-native
  done
  echo "== 3. watchdog and dump overhead (zbv, pp=$pp)" | tee -a "$out/summary.txt"
  PRIMUSPIPE_WATCHDOG_TIMEOUT_S=0 run watchdog_off "$pp" --microbatches $((4 * pp)) --pp-algorithm zbv \
    --num-layers $((4 * pp)) --hidden-size 1024 --iterations 8
  run watchdog_on "$pp" --microbatches $((4 * pp)) --pp-algorithm zbv --num-layers $((4 * pp)) --hidden-size 1024 \
    --iterations 8
  run dumping "$pp" --microbatches $((4 * pp)) --pp-algorithm zbv --num-layers $((4 * pp)) --hidden-size 1024 \
    --iterations 8 --dump-dir "$out/pp_data"
else
  echo "== 2-3 skipped: fewer than two GPUs" | tee -a "$out/summary.txt"
fi
if [ -d "$out/pp_data" ]; then
  echo "== 4. split-W speed: measured F/B/W from the dumped run" | tee -a "$out/summary.txt"
  primuspipe calibrate "$out/pp_data" -o "$out/measured_cost.yaml" 2>&1 | tee "$out/calibrate.log" | tail -n 5 \
    | tee -a "$out/summary.txt"
fi
echo "results in $out"
