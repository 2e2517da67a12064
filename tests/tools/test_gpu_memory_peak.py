"""``bench/gpu_memory_peak.py`` replays the CUDA allocator's trace to its peak: the replay itself is plain data
and is held here on generated traces against a direct count (the GPU side runs in ``bench/gpu_suite.sh`` part 7)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_memory_peak", ROOT / "bench/gpu_memory_peak.py")
peak_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peak_tool)


def _trace(seed: int) -> list[dict]:
    """Allocations and frees in random order, some frees of blocks made before the trace began (no alloc seen),
    some frees requested but not completed (still alive), each block with a frame."""
    rng = random.Random(seed)
    live, trace, address = [], [], 0
    for _ in range(200):
        if live and rng.random() < 0.45:
            addr = live.pop(rng.randrange(len(live)))
            trace.append({"action": "free_requested", "addr": addr, "size": 0})
            if rng.random() < 0.9:
                trace.append({"action": "free_completed", "addr": addr, "size": 0})
            else:
                live.append(addr)  # requested, not completed: the allocator still holds it
        elif rng.random() < 0.05:
            trace.append({"action": "free_completed", "addr": -1 - address, "size": 512})  # made before the trace
            address += 1
        else:
            address += 1
            live.append(address)
            trace.append({"action": "alloc", "addr": address, "size": rng.randrange(1, 10**6),
                          "frames": [{"filename": f"/x/torch/y{address % 3}.py", "line": 1, "name": "op"},
                                     {"filename": f"/m/model{address % 4}.py", "line": address, "name": "forward"}]})
    return trace


@pytest.mark.parametrize("seed", range(8))
def test_the_replay_finds_the_largest_total_and_what_was_alive_then(seed):
    trace = _trace(seed)
    sizes, alive, totals = {}, set(), []
    for event in trace:  # the direct count, event by event
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            alive.add(event["addr"])
        elif event["action"] == "free_completed" and event["addr"] in alive:
            alive.discard(event["addr"])
        totals.append((sum(sizes[a] for a in alive), frozenset(alive)))
    best = max(range(len(totals)), key=lambda i: (totals[i][0], -i))
    at, peak, blocks = peak_tool.live_at_peak(trace)
    assert (at, peak) == (best, totals[best][0])
    assert set(blocks) == totals[best][1]


def test_a_block_is_named_by_its_innermost_frames_outside_torch():
    frames = [{"filename": "/a/torch/nn/functional.py", "line": 9, "name": "softmax"},
              {"filename": "/b/megatron/core/fusions/fused_softmax.py", "line": 335, "name": "forward_torch_softmax"}]
    assert peak_tool.where(frames) == "fused_softmax.py:335 forward_torch_softmax"
    assert peak_tool.where([]) == "(no frames)"
