"""Every schedule under the NCCL emulator: the whole matrix the CI corners sample.

For every shipped algorithm, pp in {2, 3, 4}, microbatches in {pp, 2pp+1, 4pp} and each vpp it takes,
runs ``examples/train_gpt.py --compare-native`` (Megatron backend, with Megatron's own schedule as the
reference in the same run) and ``examples/train_torch.py`` (torch backend) under torchrun three times:
on plain gloo, with ``PRIMUSPIPE_NCCL_EMULATION=pair`` and with ``=group``. A cell passes when both
emulated runs finish (no hang: each run has a deadline) and print exactly the numbers of the gloo run
-- loss, Megatron's loss, the gradient difference to Megatron, every per-iteration loss.

    python bench/bench_nccl_matrix.py -o bench/results/nccl_matrix.json            # everything (long)
    python bench/bench_nccl_matrix.py --pp 2 --algorithms 1f1b zbv --backends gpt   # a corner

Results: one row per (backend, algorithm, pp, vpp, microbatches) with each mode's outcome and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from primuspipe.algorithms.build import build_schedule  # noqa: E402
from primuspipe.algorithms.registry import list_algorithms  # noqa: E402
from primuspipe.errors import PrimusPipeError  # noqa: E402

MODES = ("gloo", "pair", "group")
COMPARED = {"gpt": ("loss", "losses", "native_loss", "max_abs_grad_diff"), "torch": ("losses",)}


SHAPES = {"pp": lambda pp: pp, "2pp+1": lambda pp: 2 * pp + 1, "4pp": lambda pp: 4 * pp}


def cells(pps, algorithms, shapes=tuple(SHAPES)):
    """(algorithm, pp, vpp, microbatches) for every shape an algorithm builds."""
    for info in list_algorithms():
        if algorithms and info.name not in algorithms:
            continue
        vpps = [info.vpp] if info.vpp else ([1, 2] if info.placement == "interleaved" else [None])
        for pp in pps:
            for m in sorted({SHAPES[shape](pp) for shape in shapes}):
                for vpp in vpps:
                    try:
                        table = build_schedule(info.name, pp, m, vpp)
                    except PrimusPipeError:
                        continue
                    yield info.name, pp, table.vpp, m


def run(backend: str, mode: str, algorithm: str, pp: int, vpp: int, m: int, timeout_s: float) -> dict:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUSPIPE_")}
    if mode != "gloo":
        env["PRIMUSPIPE_NCCL_EMULATION"] = mode
    env["OMP_NUM_THREADS"] = "1"
    if backend == "gpt":
        layers = max(8, 2 * pp * vpp)
        flags = ["examples/train_gpt.py", "--pp", str(pp), "--microbatches", str(m), "--pp-algorithm", algorithm,
                 "--num-layers", str(layers), "--iterations", "2", "--compare-native"]
    else:
        flags = ["examples/train_torch.py", "--pp", str(pp), "--microbatches", str(m), "--algorithm", algorithm,
                 "--layers", str(max(8, pp * vpp)), "--iterations", "2"]
    if algorithm in ("interleaved-1f1b", "gpipe", "1f1b"):  # they take any vpp: pin the cell's
        flags += ["--vpp", str(vpp)]
    start = time.monotonic()
    try:
        done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(pp), *flags], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"outcome": "hang", "seconds": timeout_s}
    seconds = round(time.monotonic() - start, 1)
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() + done.stdout.splitlines()
                if ("Error" in line or "error:" in line) and "elastic" not in line][:1] or done.stderr.splitlines()[-1:]
        return {"outcome": "error", "seconds": seconds, "error": tail[0] if tail else f"exit {done.returncode}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"outcome": "ok", "seconds": seconds, **{k: result.get(k) for k in COMPARED[backend]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--algorithms", nargs="+", default=None, help="default: every shipped algorithm")
    p.add_argument("--backends", nargs="+", choices=tuple(COMPARED), default=list(COMPARED))
    p.add_argument("--microbatches", nargs="+", choices=tuple(SHAPES), default=list(SHAPES),
                   help="microbatch counts as functions of pp (default: all three)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before it counts as a hang")
    p.add_argument("-o", "--output", type=Path, default=None, help="JSON results (default: print only)")
    args = p.parse_args(argv)
    rows, failed = [], 0
    for backend in args.backends:
        for algorithm, pp, vpp, m in cells(args.pp, args.algorithms, args.microbatches):
            outcomes = {mode: run(backend, mode, algorithm, pp, vpp, m, args.timeout) for mode in MODES}
            base = outcomes["gloo"]
            equal = base["outcome"] == "ok" and all(
                o["outcome"] == "ok" and all(o[k] == base[k] for k in COMPARED[backend]) for o in outcomes.values())
            failed += not equal
            row = {"backend": backend, "algorithm": algorithm, "pp": pp, "vpp": vpp, "microbatches": m,
                   "equal_to_gloo": equal, **{mode: outcomes[mode] for mode in MODES}}
            rows.append(row)
            print(f"{backend:5} {algorithm:16} pp={pp} vpp={vpp} m={m:2}: "
                  + ("equal" if equal else "DIFFERENT") + "  "
                  + "  ".join(f"{mode} {o['outcome']} {o['seconds']}s" for mode, o in outcomes.items()), flush=True)
            if args.output:  # after every cell: a long run interrupted still leaves what it measured
                args.output.write_text(json.dumps({"rows": rows, "cells": len(rows), "equal": len(rows) - failed},
                                                  indent=1))
    print(f"{len(rows) - failed} of {len(rows)} cells equal to gloo under both emulation modes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
