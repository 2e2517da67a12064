"""What is alive on the GPU at a run's peak: the CUDA caching allocator's own trace, replayed.

    python -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_memory_peak.py [-o FILE] -- \
        examples/train_gpt.py --pp 1 ...

``primuspipe project`` counts a run's peak memory from its model of what each layer keeps and holds for a moment
(``primuspipe/projection/activations.py``), held against live bytes recorded on CPU. Where a GPU run's
``torch.cuda.max_memory_allocated`` disagrees, this says which allocations the model missed: it records the
allocator's history (``torch.cuda.memory._record_memory_history``, Python frames) around the given script, run
in this process, then replays the trace's allocations and frees to the moment of the largest allocated total
(the moment ``max_memory_allocated`` reports) and writes what was alive then, largest first, each with the
innermost frames that made it; blocks made before the trace began (weights, optimizer state) are counted as one
line. Allocations the autograd engine makes have no Python frames: the trace's neighbours of each large block
(the events just before and after it) are listed so that a backward block can be placed by what surrounds it.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

import torch

FRAMES = 4  # innermost Python frames kept per block
LARGE = 64 * 2**20  # blocks at least this big are listed one by one


def where(frames: list[dict]) -> str:
    """The innermost frames outside torch's own Python code, as ``file:line name`` joined by '<'."""
    kept = [f for f in frames if "/torch/" not in f["filename"]] or frames
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in kept[:FRAMES]) or "(no frames)"


def live_at_peak(trace: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """Replay ``alloc`` / ``free_completed``: the peak's event index, its total, the blocks alive then."""
    live: dict[int, dict] = {}
    total = peak = peak_at = 0
    alive_then: dict[int, dict] = {}
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = {**event, "index": index}
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, peak_at, alive_then = total, index, dict(live)
    return peak_at, peak, alive_then


def report(snapshot: dict, device: int) -> dict:
    trace = snapshot["device_traces"][device]
    peak_at, traced_peak, alive = live_at_peak(trace)
    max_allocated = torch.cuda.max_memory_allocated(device)
    groups: dict[str, int] = {}
    for block in alive.values():
        key = where(block.get("frames", []))
        groups[key] = groups.get(key, 0) + block["size"]
    large = sorted((b for b in alive.values() if b["size"] >= LARGE), key=lambda b: -b["size"])
    def neighbours(index: int) -> list[str]:
        around = trace[max(0, index - 3):index + 4]
        return [f"{e['action']} {e['size'] / 2**20:.1f} MiB {where(e.get('frames', []))}" for e in around]
    return {
        "max_memory_allocated_bytes": max_allocated,
        "traced_peak_bytes": traced_peak,
        "before_trace_bytes": max_allocated - traced_peak,
        "peak_event": peak_at, "events": len(trace),
        "peak_neighbourhood": neighbours(peak_at),
        "alive_by_frames": [{"bytes": size, "frames": key}
                            for key, size in sorted(groups.items(), key=lambda kv: -kv[1])[:40]],
        "large_blocks": [{"bytes": b["size"], "allocated_at_event": b["index"], "frames": where(b.get("frames", [])),
                          "neighbours": neighbours(b["index"])} for b in large[:30]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, default=Path("gpu_memory_peak.json"))
    parser.add_argument("--max-entries", type=int, default=4_000_000)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script or not torch.cuda.is_available():
        sys.exit("gpu_memory_peak.py: needs CUDA and a script to run (-- examples/train_gpt.py ...)")
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    sys.argv = script
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    device = torch.cuda.current_device()
    result = report(torch.cuda.memory._snapshot(), device)
    torch.cuda.memory._record_memory_history(enabled=None)
    args.output.write_text(json.dumps(result, indent=1))
    print(f"peak {result['max_memory_allocated_bytes'] / 1e9:.3f} GB allocated, "
          f"{result['traced_peak_bytes'] / 1e9:.3f} GB of it traced; top: "
          + "; ".join(f"{g['bytes'] / 1e9:.3f} GB {g['frames']}" for g in result["alive_by_frames"][:6]))


if __name__ == "__main__":
    main()
