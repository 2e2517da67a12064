"""Where a GPU run's step goes, kernel by kernel: the CUDA kernels of a script, timed by torch's profiler.

    python -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_step_kernels.py --steps N \
        [-o FILE] -- examples/train_gpt.py --pp 1 --iterations N ...

``primuspipe project`` prices a step as the sum of its kernels (GEMMs by shape, attention, element-wise traffic,
the optimizer) plus what the host adds. Where a measured step and the projection disagree, this says which
kernels carry the difference: it runs the given script in this process under ``torch.profiler`` (CUDA activity)
and writes each kernel name's total device time per step (the total over the whole run divided by ``--steps``,
the script's iteration count: the first step's one-off work is spread over all), largest first, with a coarse
category for each, and the sum of the kernels' time per step. Copies to and from the host are listed apart
("transfer", left out of the sum): a synchronous copy's span includes its wait for the kernels before it.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = (  # first match wins: (category, substrings of the kernel's name, lower case)
    ("transfer", ("memcpy",)),  # host copies' spans include their wait for the stream: not kernel time
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("softmax", ("softmax",)),
    ("layer_norm", ("layer_norm", "layernorm", "rms_norm")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("reduction", ("reduce", "sum_kernel", "norm_kernel")),
    ("copy", ("memcpy", "memset", "copy", "cat")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "gelu", "dropout", "where", "fill")),
)


def category(name: str) -> str:
    lowered = name.lower()
    return next((label for label, keys in CATEGORIES if any(k in lowered for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, default=Path("gpu_step_kernels.json"))
    parser.add_argument("--steps", type=int, required=True, help="the script's iteration count (its --iterations)")
    parser.add_argument("--top", type=int, default=40, help="kernels listed one by one")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script or not torch.cuda.is_available():
        sys.exit("gpu_step_kernels.py: needs CUDA and a script to run (-- examples/train_gpt.py ...)")
    sys.argv = script
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        try:
            runpy.run_path(script[0], run_name="__main__")
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name][0] += event.device_time_total / 1e6 / args.steps
            per_name[event.name][1] += 1
    kernels = sorted(({"name": n, "category": category(n), "s_per_step": t, "calls": c}
                      for n, (t, c) in per_name.items()), key=lambda k: -k["s_per_step"])
    by_category: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_category[k["category"]] += k["s_per_step"]
    result = {"script": script, "steps": args.steps,
              "kernel_s_per_step": sum(t for c, t in by_category.items() if c != "transfer"),
              "by_category_s_per_step": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
              "kernels": kernels[:args.top]}
    args.output.write_text(json.dumps(result, indent=1))
    print(json.dumps({"kernel_s_per_step": round(result["kernel_s_per_step"], 5),
                      "by_category": {c: round(t, 5) for c, t in result["by_category_s_per_step"].items()}}))


if __name__ == "__main__":
    main()
