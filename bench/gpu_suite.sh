#!/usr/bin/env bash
# Everything in primuspipe that only a GPU machine can measure, in one run; one GPU is enough (ranks that
# outnumber the GPUs share them: bench/nccl_one_gpu.py gives each its own NCCL host id).
#   [PARTS="..."] [NCCL_PPS="2 3 4"] bash bench/gpu_suite.sh [OUT_DIR]          (default out/gpu_suite; one JSON/log per part, summary.txt)
# Parts (each under its own time limit, so one stuck part cannot take the others' figures with it):
#   1. gpu-marked tests (recorder, offload; NCCL and Transformer Engine ones skip without 2 GPUs / TE)
#   2. NCCL on the GPU against the emulator: every communication pattern of bench/nccl_one_gpu.py on real NCCL
#      (lazy and eager communicators), joined with the emulator's verdicts (bench/results/nccl_one_gpu_emulator.json)
#      (NCCL_PATTERNS="a b": only those patterns)
#   3. every shipped algorithm through examples/train_gpt.py --compare-native on real NCCL (NCCL_PPS, default "2";
#      "2 3 4" also runs pp 3 and 4, all ranks on whatever GPUs there are): it must finish with Megatron's own
#      schedule's gradients
#   4. kernels against the projection's model of them (bench/bench_gpu_kernels.py)
#   5. one GPU, a megatron-core GPT in bf16: 1f1b with --auto-replan and zb-h1, CUDA-event timelines dumped and
#      calibrated (memory per step, layer spans inside their nodes), and `primuspipe project` of the same run
#      (analytical and with --benchmark-layers)
#   6. with two GPUs or more: primuspipe's runner against Megatron's own schedule, watchdog and dump overhead
#   7. one GPU, the model of part 5: what is alive at its peak memory (bench/gpu_memory_peak.py: the allocator's
#      trace replayed), against what the projection counts
#   8. in-flight re-planning on real NCCL at pp 2 (two ranks on the one GPU), a switch forced among zb-h1/zb-h2
#   9. one GPU: the local spec at part 5's shape and two more (step time and steady peak memory, 1f1b and zb-h1), for
#      bench/bench_local_spec.py to hold the projection against
#  10. one GPU: the local-spec shapes' layers timed (what --benchmark-layers measures) against the analytical model
#  11. one GPU: each local-spec shape's 1f1b step kernel by kernel (bench/gpu_step_kernels.py: torch's profiler)
# PARTS="3 7 8" runs only those parts (default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu_suite}
mkdir -p "$out"
py=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpus=$($py -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus" | tee "$out/summary.txt"
$py -c "import torch, json; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': torch.cuda.nccl.version(), 'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))" | tee "$out/environment.json"
cli=($py -c "import sys; from primuspipe.cli import main; sys.exit(main())")  # the console script, uninstalled
part() { echo "== $1 ($(date -u +%T))" | tee -a "$out/summary.txt"; }
want() { [[ " ${PARTS:-1 2 3 4 5 6 7 8 9 10 11} " == *" $1 "* ]]; }  # PARTS="3 7": only those parts
# the one-GPU model of parts 5 and 7: megatron-core's local spec, bf16
model=(--num-layers 4 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048
       --micro-batch-size 4 --vocab-size 64 --bf16 --optimizer adam --lr 1e-4 --no-gradient-accumulation-fusion)
# the two shapes of parts 9 and 10 nothing was fitted on (bench/data/local_shape_{a,b}_args.txt in Megatron-LM's form)
shapes=("a:--num-layers 6 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 8 --seq-length 4096
         --micro-batch-size 2 --vocab-size 32000 --untie-embeddings-and-output-weights"
        "b:--num-layers 8 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 --seq-length 1024
         --micro-batch-size 8 --vocab-size 50304 --disable-bias-linear")

if want 1; then
part "1. gpu-marked tests"
timeout 150 $py -m pytest -q -m gpu -p no:cacheprovider tests/runtime tests/offload tests/megatron/test_te_gpu.py tests/projection/test_benchmark.py \
  2>&1 | tee "$out/gpu_tests.log" | tail -n 3 | tee -a "$out/summary.txt"

fi
if want 2; then
part "2. NCCL patterns against the emulator"
timeout 240 $py bench/nccl_one_gpu.py patterns --modes nccl-lazy nccl-eager --deadline 20 --parallel 8 \
  ${NCCL_PATTERNS:+--patterns $NCCL_PATTERNS} \
  --with bench/results/nccl_one_gpu_emulator.json -o "$out/nccl_patterns.json" 2>"$out/nccl_patterns.log" \
  | tee -a "$out/summary.txt"

fi
if want 3; then
part "3. every algorithm on real NCCL against Megatron's schedule, pp ${NCCL_PPS:=2}"
algorithms=$($py -c "from primuspipe.algorithms.registry import list_algorithms; print(*[i.name for i in list_algorithms()])")
one() {  # one PP ALGORITHM -> $out/nccl_train_ppPP_ALGORITHM.json (the launcher's verdict, then the example's JSON line)
  local pp=$1 algo=$2 log="$out/nccl_train_pp$1_$2.json"
  timeout 240 $py bench/nccl_one_gpu.py train --ranks "$pp" --deadline 200 -- examples/train_gpt.py --pp "$pp" \
    --microbatches $((2 * pp + 1)) --pp-algorithm "$algo" --num-layers $((4 * pp)) --iterations 2 --compare-native \
    --no-gradient-accumulation-fusion > "$log" 2>&1
  echo "   pp $pp $algo: exit $? $(tail -n 1 "$log" | cut -c1-200)"
}
export -f one; export out py
for pp in $NCCL_PPS; do printf "$pp %s\n" $algorithms; done | xargs -P "${NCCL_PARALLEL:-4}" -L 1 bash -c 'one "$0" "$1"' \
  | tee -a "$out/summary.txt"

fi
if want 4; then
part "4. kernels against the projection's model"
timeout 240 $py bench/bench_gpu_kernels.py --output "$out/gpu_kernels.json" --markdown "$out/gpu_kernels.md" \
  2>"$out/gpu_kernels.log" | tail -n 8 | tee -a "$out/summary.txt"

fi
if want 5; then
part "5. one GPU: megatron-core GPT, auto-replan, CUDA-event dump, calibrate, projection"
for algo in 1f1b zb-h1; do  # 1f1b re-planning in flight (pp 1: nothing to switch to, the prediction is checked)
  extra=(); [ "$algo" = 1f1b ] && extra=(--auto-replan)
  timeout 150 $py -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_gpt.py --pp 1 --microbatches 8 \
    --iterations 8 --pp-algorithm $algo "${extra[@]}" --dump-dir "$out/pp_data_$algo" "${model[@]}" > "$out/single_gpu_$algo.log" 2>&1
  tail -n 1 "$out/single_gpu_$algo.log" | tee "$out/single_gpu_$algo.json" | cut -c1-400 | tee -a "$out/summary.txt"
  timeout 60 "${cli[@]}" calibrate "$out/pp_data_$algo" -o "$out/measured_cost_$algo.yaml" > "$out/calibrate_$algo.log" 2>&1
  tail -n 4 "$out/calibrate_$algo.log" | tee -a "$out/summary.txt"
  $py - "$out/pp_data_$algo" <<'PY' | tee -a "$out/summary.txt"
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/iter_*/rank_0.json")):  # memory must not grow; parts within their nodes
    d = json.load(open(f)); r = d["ranks"][0]
    over = max(sum((e.get(p) or [0])[0] or 0 for p in ("layers", "ends")) - (e["end"] - e["start"]) for e in r["events"])
    print(f"   {f.split('/')[-2]}: peak {r['peak_memory_bytes'] / 1e9:.3f} GB, at start {d['meta']['memory_at_start'] / 1e9:.3f} GB,"
          f" layers + ends beyond the node {over * 1e3:+.3f} ms")
PY
done
# the example builds its TransformerConfig with the softmax in fp32 (megatron-core's default); Megatron-LM needs the flag
cat > "$out/single_gpu_args.txt" <<EOF
torchrun --nproc-per-node 1 pretrain_gpt.py --num-layers 4 --hidden-size 2048 --ffn-hidden-size 8192
--num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32
--vocab-size 64 --position-embedding-type learned_absolute --normalization LayerNorm --transformer-impl local
--no-bias-gelu-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion
--hidden-dropout 0 --attention-dropout 0 --bf16 --optimizer adam --attention-softmax-in-fp32
EOF
hardware=examples/projection/hardware/h100.yaml
timeout 60 "${cli[@]}" project --megatron-config "$out/single_gpu_args.txt" --hardware $hardware -a 1f1b --json \
  > "$out/project_analytical.json" 2>"$out/project_analytical.log"
timeout 120 "${cli[@]}" project --megatron-config "$out/single_gpu_args.txt" --hardware $hardware -a 1f1b --json \
  --benchmark-layers > "$out/project_benchmarked.json" 2>"$out/project_benchmarked.log"
$py - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, sys
d = sys.argv[1]
measured = json.load(open(f"{d}/single_gpu_1f1b.json"))
for name in ("analytical", "benchmarked"):
    try:
        r = json.load(open(f"{d}/project_{name}.json"))["results"][0]
        print(f"   projected ({name}) step {r['step_time_s']:.4f} s, peak {r['peak_memory_bytes'][0] / 2**30:.2f} GiB"
              f" (with the runtime reserve); measured step {measured.get('step_time_before_s')} s before any switch")
    except Exception as error:
        print(f"   projected ({name}): {type(error).__name__}: {error}")
PY

fi
if want 6 && [ "$gpus" -ge 2 ]; then
  run() {  # run NAME PP FLAGS... -> the example's JSON line in $out/NAME.json
    local name=$1 pp=$2; shift 2
    $py -m torch.distributed.run --standalone --nproc-per-node "$pp" examples/train_gpt.py --pp "$pp" "$@" \
      2>"$out/$name.log" | tail -n 1 > "$out/$name.json" && echo "   $name: $(cat "$out/$name.json")" | tee -a "$out/summary.txt"
  }
  pp=$([ "$gpus" -ge 4 ] && echo 4 || echo 2)
  part "6. runner vs Megatron native, watchdog and dump overhead (pp=$pp)"
  for algo in 1f1b interleaved-1f1b zb-h1 zbv; do
    run "native_vs_$algo" "$pp" --microbatches $((4 * pp)) --pp-algorithm "$algo" --num-layers $((4 * pp)) \
      --hidden-size 1024 --iterations 8 --compare-native
  done
  PRIMUSPIPE_WATCHDOG_TIMEOUT_S=0 run watchdog_off "$pp" --microbatches $((4 * pp)) --pp-algorithm zbv \
    --num-layers $((4 * pp)) --hidden-size 1024 --iterations 8
  run watchdog_on "$pp" --microbatches $((4 * pp)) --pp-algorithm zbv --num-layers $((4 * pp)) --hidden-size 1024 \
    --iterations 8
fi
if want 7; then
part "7. one GPU: what is alive at the local spec's peak memory (the CUDA allocator's trace replayed)"
timeout 180 $py -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_memory_peak.py \
  -o "$out/memory_peak_1f1b.json" -- examples/train_gpt.py --pp 1 --microbatches 8 --iterations 3 --pp-algorithm 1f1b \
  "${model[@]}" > "$out/memory_peak.log" 2>&1
echo "   exit $? $(tail -n 1 "$out/memory_peak.log" | cut -c1-600)" | tee -a "$out/summary.txt"
fi

if want 8; then  # two ranks on the one GPU: the mechanics (CUDA events, the decision's broadcast, the switch), not speed
part "8. in-flight re-planning on real NCCL, pp 2, among zb-h1/zb-h2 (a switch is certain)"
PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS=zb-h1,zb-h2 timeout 240 $py bench/nccl_one_gpu.py train --ranks 2 --deadline 200 -- \
  examples/train_gpt.py --pp 2 --microbatches 8 --pp-algorithm 1f1b --auto-replan --num-layers 8 --iterations 10 \
  --compare-native --no-gradient-accumulation-fusion > "$out/nccl_auto_replan_pp2.json" 2>&1
echo "   exit $? $(tail -n 1 "$out/nccl_auto_replan_pp2.json" | cut -c1-500)" | tee -a "$out/summary.txt"
fi

if want 9; then  # shapes nothing was fitted on, for `bench/bench_local_spec.py` to set beside their projections
part "9. one GPU: the local spec at part 5's shape and two more, 1f1b and zb-h1 (step time, steady peak memory)"
for shape in "base:${model[*]}" "${shapes[@]}"; do
  name=${shape%%:*}; read -ra flags <<< "$(echo ${shape#*:})"
  [ "$name" = base ] || flags+=(--bf16 --optimizer adam --lr 1e-4 --no-gradient-accumulation-fusion)
  for algo in 1f1b zb-h1; do
    run=shape_${name}_$algo
    timeout 150 $py -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_gpt.py --pp 1 --microbatches 8 \
      --iterations 5 --pp-algorithm $algo --dump-dir "$out/$run" "${flags[@]}" > "$out/$run.log" 2>&1
    $py - "$out/$run" <<'PY' | tee -a "$out/shapes.jsonl" | tee -a "$out/summary.txt"
import glob, json, statistics, sys
run = sys.argv[1]
try:  # the steady peak: iterations after the first, whose optimizer state does not exist yet
    peaks = [json.load(open(f))["ranks"][0]["peak_memory_bytes"] for f in sorted(glob.glob(run + "/iter_*/rank_0.json"))[1:]]
    step = json.loads(open(run + ".log").read().strip().splitlines()[-1])["step_time_s"]
    print(json.dumps({"run": run.rsplit("/", 1)[-1], "step_time_s": step, "steady_peak_bytes": statistics.median(peaks)}))
except Exception as error:
    print(json.dumps({"run": run.rsplit("/", 1)[-1], "error": f"{type(error).__name__}: {error}"}))
PY
  done
done
fi

if want 10; then  # the local spec's layers on the GPU, beside the analytical model and the projection they calibrate
part "10. one GPU: the local-spec shapes' layers timed against the analytical model"
timeout 200 $py - "$out" <<'PY' 2>"$out/layer_factors.log" | tee -a "$out/summary.txt"
import json, sys
from primuspipe.projection.benchmark.layers import calibration_from_timings, measure
from primuspipe.projection.compute import PASSES, Calibration, WorkModel
from primuspipe.projection.benchmark.layers import benchmark_shape
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import read_megatron_config
from primuspipe.projection.projection import Projector
hardware = load_hardware("examples/projection/hardware/h100.yaml")
rows = {}
for shape, path in (("base", "bench/data/single_gpu_h100_args.txt"), ("a", "bench/data/local_shape_a_args.txt"),
                    ("b", "bench/data/local_shape_b_args.txt")):
    config = read_megatron_config(path)
    measured = measure(config.model, config.training, iterations=10, warmup=3)
    calibration = calibration_from_timings(config.model, config.training, hardware, measured, source="layers, H100")
    bench_model, bench_training = benchmark_shape(config.model, config.training)
    work = WorkModel(bench_model, bench_training)
    row = {"measured_s": {f"{part} {name}": t for (part, name), t in measured.items()},
           "analytical_s": {f"{part} {name}": w.seconds(hardware, bench_training.precision, backward=name != "forward")
                            for part in {p for p, _ in measured} for name, w in zip(PASSES, work.part(part).passes())},
           "factors": {f"{part} {name}": f for (part, name), f in calibration.factors.items()}}
    for label, cal in (("analytical", Calibration()), ("benchmarked", calibration)):
        row[f"step_{label}_s"] = {a: Projector(config.model, hardware, cal).evaluate(config.training, a).step_time_s
                                  for a in ("1f1b", "zb-h1")}
    rows[shape] = row
    print(f"   {shape}: step analytical {row['step_analytical_s']['1f1b']:.4f} s, with layers timed "
          f"{row['step_benchmarked_s']['1f1b']:.4f} s; factors " + ", ".join(f"{k} {v:.3f}" for k, v in row["factors"].items()))
json.dump(rows, open(sys.argv[1] + "/layer_factors.json", "w"), indent=1)
PY
fi
if want 11; then
part "11. one GPU: each local-spec shape's 1f1b step, kernel by kernel (torch's profiler)"
for shape in "base:${model[*]}" "${shapes[@]}"; do
  name=${shape%%:*}; read -ra flags <<< "$(echo ${shape#*:})"
  [ "$name" = base ] || flags+=(--bf16 --optimizer adam --lr 1e-4 --no-gradient-accumulation-fusion)
  timeout 150 $py -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_step_kernels.py --steps 5 \
    -o "$out/kernels_$name.json" -- examples/train_gpt.py --pp 1 --microbatches 8 --iterations 5 --pp-algorithm 1f1b \
    "${flags[@]}" > "$out/kernels_$name.log" 2>&1
  echo "   $name kernels: exit $? $(grep kernel_s_per_step "$out/kernels_$name.log" | tail -n 1 | cut -c1-400)" | tee -a "$out/summary.txt"
done
fi

part "done"
echo "results in $out"
