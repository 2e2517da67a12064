"""``dump_pp_data``: what a real step did, per rank, in the timeline format the simulator also writes.

Each rank writes ``<dump_dir>/iter_<iteration>/rank_<rank>.json``: a :class:`~primuspipe.ir.timeline.Timeline`
with ``source="run"`` holding that rank's events (seconds from the rank's step start) and its peak
memory: peak allocated bytes on GPU (the CUDA peak counter is reset at step start), peak resident set
size sampled at every node boundary on CPU. ``meta["t0_unix"]`` is the rank's step start on the wall
clock, so :func:`~primuspipe.ir.timeline.merge_rank_dumps` can lay all ranks on one time axis, and
``meta["run_id"]`` is the run's id, the same on every rank of the pipeline (:func:`shared_run_id`), so
readers never merge files of two runs left in one directory. Files are written atomically (a rank
killed mid-write leaves no half file), so an iteration on disk is whole or visibly missing ranks.

On GPU every recorded time is taken after ``torch.cuda.synchronize()``, so a dumped step measures
kernels, not launches (and runs slower than an undumped one).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable
from primuspipe.ir.timeline import RankTimeline, TimedNode, Timeline

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: fall back to the process-lifetime peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepRecorder:
    """A :class:`~primuspipe.runtime.runner.Recorder` for one step of one rank."""

    def __init__(self, device: torch.device, run_id: str | None = None):
        self.run_id = run_id
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self.device = device
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()
        self.events: list[TimedNode] = []
        self._peak_rss = _rss_bytes() if not self.cuda else 0

    def clock(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        else:
            self._peak_rss = max(self._peak_rss, _rss_bytes())
        return time.perf_counter() - self.t0

    def record(self, node: ScheduleNode, start: float, end: float) -> None:
        self.events.append(TimedNode(node, start, end))

    def peak_memory_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(self._peak_rss, _rss_bytes())

    def timeline(self, table: ScheduleTable, rank: int, iteration: int) -> Timeline:
        events = tuple(sorted(self.events, key=lambda e: (e.start, e.end)))
        return Timeline(
            source="run", algorithm=table.algorithm, pp=table.pp, vpp=table.vpp, microbatches=table.microbatches,
            ranks=(RankTimeline(rank, events, self.peak_memory_bytes()),), iteration=iteration,
            meta={"t0_unix": self.t0_unix, "run_id": self.run_id, "device": str(self.device),
                  "memory": "peak allocated" if self.cuda else "peak RSS",
                  "placement": table.placement.to_dict()},
        )


def shared_run_id(group: Any) -> str:
    """An id for this run of the pipeline ``group``, the same on all its ranks: each rank offers a fresh
    one to the default store and the first offer wins (no collective, so no rank waits on another).
    A torchrun restart (``TORCHELASTIC_RESTART_COUNT``) is a new run."""
    from primuspipe.runtime.transport import default_store

    mine = uuid.uuid4().hex[:12]
    store = default_store()
    if store is None:
        return mine
    first = dist.get_process_group_ranks(group)[0]
    key = f"primuspipe/run_id/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{first}"
    return store.compare_set(key, "", mine).decode()
