"""primuspipe beside torch.distributed.pipelining 2.13: the same model and tables, measured and simulated.

    flock /tmp/primuspipe-cpu.lock python bench/bench_vs_torch.py [--steps 30] [--hidden 256] [--out PATH]

1. **Runtime** (CPU, gloo, pp=2, one thread per rank): a plain 8-layer model (Linear, GELU,
   LayerNorm) trained with each algorithm through primuspipe's torch backend and through torch's
   ``_PipelineScheduleRuntime`` running the same table from primuspipe's CSV, on the same weights and
   data. Steps alternate between the two (primuspipe first on even steps) after a warm-up; a step's
   time is its slowest rank's. Reported per algorithm: medians, and the median of per-step ratios
   primuspipe / torch (< 1: primuspipe faster). Also, per stage of the model, the FLOPs of ``B`` + ``W``
   against ``BW`` (torch's FLOP counter): equal means ``W`` recomputes no input gradient.
2. **Simulated step time** of primuspipe's ``zbv`` and ``dualpipe-v`` (built for the costs) against
   torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` orders (exported from torch's classes
   now, read as primuspipe tables, same communication pass, same simulator) over pp in {4, 8},
   m in {p, p+1, 2p+1, 4p} and (F, B, W) per 1F1B stage in {(1, 1, 1), (1, 1.5, 0.5)}, split evenly
   over the two chunks; free point-to-point. ``ratio`` is primuspipe / torch (> 1: torch's order is
   faster); torch's DualPipeV needs m >= 2p.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

ALGORITHMS = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("v-half", 2), ("dualpipe-v", 2),
              ("zb-auto", 1)]
SIM_PAIRS = [("zbv", "ScheduleZBVZeroBubble"), ("dualpipe-v", "ScheduleDualPipeV")]
COSTS = {"1:1": (1.0, 1.0, 1.0), "1.5:0.5": (1.0, 1.5, 0.5)}


def runtime_bench(args) -> dict:
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.backends.torch import TorchPipeline, split_sequential
    from primuspipe.testing.gloo import run_gloo
    from primuspipe.testing.torch_pipelining import mse, plain_model, torch_runtime, torch_step

    pp, m = 2, args.microbatches
    tables = {alg: build_schedule(alg, pp, m, vpp) for alg, vpp in ALGORITHMS}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.microbatch_size * m, args.hidden, generator=gen)
    y = torch.randn(args.microbatch_size * m, args.hidden, generator=gen)

    def work(rank, world):
        import torch.distributed as dist

        times = {}
        for alg, table in tables.items():
            def stages():
                cut = split_sequential(plain_model(args.hidden), table.num_stages)
                return {s: cut[s] for s in table.placement.stages[rank]}

            ours_modules, theirs_modules = stages(), stages()
            pipe = TorchPipeline(table, ours_modules, loss_fn=mse)
            runtime = torch_runtime(table, theirs_modules, mse)
            runs = {"primuspipe": lambda: pipe.step(x, target=y),
                    "torch": lambda: torch_step(runtime, pipe.has_first_stage, pipe.has_last_stage, (x,), y)}
            mods = {"primuspipe": ours_modules, "torch": theirs_modules}
            seconds = {name: [] for name in runs}
            for step in range(args.warmup + args.steps):
                for name in (("primuspipe", "torch") if step % 2 == 0 else ("torch", "primuspipe")):
                    for module in mods[name].values():
                        module.zero_grad()
                    dist.barrier()
                    start = time.perf_counter()
                    runs[name]()
                    if step >= args.warmup:
                        seconds[name].append(time.perf_counter() - start)
            times[alg] = seconds
        return times

    per_rank = run_gloo(work, pp, timeout_s=3600)
    out = {}
    for alg in tables:
        step = {name: [max(r[alg][name][i] for r in per_rank) for i in range(args.steps)]
                for name in ("primuspipe", "torch")}
        ours, theirs = step["primuspipe"], step["torch"]
        out[alg] = {"primuspipe_median_s": statistics.median(ours), "torch_median_s": statistics.median(theirs),
                    "ratio_median": statistics.median(o / t for o, t in zip(ours, theirs)),
                    "primuspipe_s": ours, "torch_s": theirs}
    return {"pp": pp, "microbatches": m, "hidden": args.hidden, "layers": 8, "microbatch_size": args.microbatch_size,
            "steps": args.steps, "warmup": args.warmup, "threads_per_rank": 1, "algorithms": out}


def split_backward_flops(hidden: int, microbatch_size: int) -> list[dict]:
    """Per stage of the model cut in 4: FLOPs of F, B, W and BW on one microbatch."""
    from torch.utils.flop_counter import FlopCounterMode

    from primuspipe.backends.torch import split_sequential
    from primuspipe.backends.torch.split_backward import backward_input
    from primuspipe.testing.torch_pipelining import plain_model

    rows = []
    for stage, module in enumerate(split_sequential(plain_model(hidden), 4)):
        x = torch.randn(microbatch_size, hidden, requires_grad=stage > 0)
        counted = {}
        for split in (True, False):
            module.zero_grad()
            with FlopCounterMode(display=False) as f:
                y = module(x)
            counted["F"] = f.get_total_flops()
            grad = torch.ones_like(y)
            with FlopCounterMode(display=False) as b:
                if split:
                    _, deferred = backward_input([y], [grad], [x] if stage else [])
                    counted["B"] = b.get_total_flops()
                    deferred.run()
                    counted["W"] = b.get_total_flops() - counted["B"]
                else:
                    torch.autograd.backward([y], [grad])
                    counted["BW"] = b.get_total_flops()
        rows.append({"stage": stage, **counted, "B_plus_W_equals_BW": counted["B"] + counted["W"] == counted["BW"]})
    return rows


def simulated_bench() -> list[dict]:
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.errors import ScheduleShapeError
    from primuspipe.ir.cost_model import CostModel, split_stages
    from primuspipe.io.formats import from_torch_csv
    from primuspipe.passes.communication import add_communication
    from primuspipe.passes.validation import validate
    from primuspipe.simulator import simulate
    from primuspipe.testing.torch_pipelining import torch_orders

    rows = []
    for pp in (4, 8):
        for m in (pp, pp + 1, 2 * pp + 1, 4 * pp):
            for ratio, (f, b, w) in COSTS.items():
                per_chunk = [split_stages(name, value, pp, 2) for name, value in (("F", f), ("B", b), ("W", w))]
                cost = CostModel.per_stage(2 * pp, *per_chunk)
                for ours_name, torch_name in SIM_PAIRS:
                    row = {"pp": pp, "microbatches": m, "B:W": ratio, "algorithm": ours_name, "torch": torch_name}
                    try:
                        ours = build_schedule(ours_name, pp, m, 2, cost=cost)
                        row["primuspipe_step"] = simulate(ours, cost).step_time
                    except ScheduleShapeError as exc:
                        row["primuspipe_step"], row["primuspipe_refused"] = None, str(exc)
                    try:
                        compute_only, _ = torch_orders(torch_name, pp, 2, m)
                    except (ValueError, AssertionError, RuntimeError) as exc:
                        row["torch_step"], row["torch_refused"] = None, str(exc).splitlines()[0]
                    else:
                        table = validate(add_communication(from_torch_csv(compute_only, torch_name).compute_only()))
                        row["torch_step"] = simulate(table, cost).step_time
                    if row["primuspipe_step"] is not None and row["torch_step"] is not None:
                        row["ratio"] = round(row["primuspipe_step"] / row["torch_step"], 4)
                    rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per schedule and algorithm")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--skip-runtime", action="store_true", help="only the simulated comparison")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "vs_torch.json"))
    args = p.parse_args()
    result = {"bench": "vs_torch", "torch": torch.__version__, "host": platform.node(),
              "python": platform.python_version(),
              "split_backward_flops": split_backward_flops(args.hidden, args.microbatch_size),
              "simulated": simulated_bench()}
    if not args.skip_runtime:
        result["runtime"] = runtime_bench(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for row in result["simulated"]:
        print(f"sim pp={row['pp']} m={row['microbatches']:>2} B:W={row['B:W']:<7} {row['algorithm']:<10} "
              f"{row['primuspipe_step']} vs torch {row['torch_step']} ratio {row.get('ratio')}")
    for alg, r in result.get("runtime", {}).get("algorithms", {}).items():
        print(f"run {alg:<16} primuspipe {r['primuspipe_median_s'] * 1e3:7.2f} ms  torch {r['torch_median_s'] * 1e3:7.2f} ms"
              f"  ratio {r['ratio_median']:.3f}")
    print("B+W == BW FLOPs on every stage:", all(r["B_plus_W_equals_BW"] for r in result["split_backward_flops"]))


if __name__ == "__main__":
    main()
