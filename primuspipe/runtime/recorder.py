"""``dump_pp_data``: what a real step did, per rank, in the timeline format the simulator also writes.

Each rank writes ``<dump_dir>/iter_<iteration>/rank_<rank>.json``: a :class:`~primuspipe.io.timeline.Timeline`
with ``source="run"`` holding that rank's events (seconds from the rank's step start) and its peak
memory: peak allocated bytes on GPU (the CUDA peak counter is reset at step start), peak resident set
size sampled at the end of every compute node on CPU; ``meta["memory_at_start"]`` is the same measure at
step start (what the step's activations come on top of). ``meta["t0_unix"]`` is the rank's step start on
the wall clock, so :func:`~primuspipe.io.run_dumps.merge_rank_dumps` can lay all ranks on one time axis. ``meta["run_id"]`` is the
run's id, the same on every rank of the pipeline (:func:`shared_run_id`), so readers never merge files of
two runs left in one directory. Files are written atomically (a rank killed mid-write leaves no half
file), so an iteration on disk is whole or visibly missing ranks.

On CPU every time is read from that same wall clock, so ranks of one host line up exactly (a second
clock paired with it at step start would be off by however long the process was descheduled between
the two reads). Each event also carries the CPU time of the rank's own thread at its start and end,
and SEND/RECV events the size of their tensor; ``meta`` says where the rank ran (``host``, ``cpus``: the
cores it may use, ``threads``: torch's intra-op threads) and the CPU time the step took on this
thread (``thread_cpu``) and on all of the process's (``process_cpu``, communication threads included).
Calibration reads these to tell compute from waiting for a core when ranks share cores.

On GPU the clock is a CUDA event recorded on the current stream, so recording never waits for the
device: a node's start and end are when the stream reached them, i.e. kernel time, not launch time.
The events are read once, when the step's timeline is built (one synchronisation per step, plus one
at step start so the first event lines up with ``t0_unix``); a dumped step runs as fast as an
undumped one, short of the event records themselves.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from primuspipe import strict
from primuspipe.errors import ConfigError
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.timeline import RankTimeline, TimedNode, Timeline

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Stamp(float):
    """A CPU timestamp: seconds from the step start, carrying this thread's CPU seconds by then."""

    __slots__ = ("cpu",)
    cpu: float


class _ResidentSetSize:
    """The process's resident set size, read from ``/proc/self/statm`` through a descriptor kept open
    (about 2 us a read, against 13 us for opening the file each time)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:  # not Linux: the process-lifetime peak is all there is
            self._fd = None

    def __call__(self) -> int:
        if self._fd is None:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return int(os.pread(self._fd, 64, 0).split()[1]) * _PAGE

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def checked_device(value: Any, name: str = "device") -> torch.device:
    """``value`` as a torch.device that exists here: ``"cpu"`` (docs/backends.md's own example) was an
    AttributeError once a step recorded, ``3`` (torch's ``cuda:3``) or a missing GPU ran on without a word until
    the recorder asked CUDA for it, and text torch cannot read its RuntimeError."""
    try:
        if isinstance(value, bool):  # an int to torch: True was cuda:1
            raise TypeError("true or false is no device")
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{name} must be a torch.device or its name (e.g. 'cpu', 'cuda:0'), got "
                          f"{strict.show(value)}: {str(exc).splitlines()[0]}") from None
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= visible:
        raise ConfigError(f"{name} {device} does not exist here ({visible} CUDA devices visible); give one of them "
                          "or 'cpu'")
    return device


class StepRecorder:
    """A :class:`~primuspipe.runtime.protocols.Recorder` for one step of one rank.

    :meth:`clock` returns a timestamp that only :meth:`record` interprets -- a :class:`Stamp` on CPU, a
    recorded CUDA event on GPU -- so the runner never needs the time itself while the step runs.
    """

    def __init__(self, device: torch.device, run_id: str | None = None):
        self.run_id = run_id
        self.cuda = device.type == "cuda"
        self.device = device
        self.events: list[tuple[ScheduleNode, Any, Any, int | None, tuple]] = []
        self._inside: list[tuple[str, Any, Any, float]] = []
        """Spans in parts of the model (:meth:`inside`) since the last compute node was recorded."""
        self.compute_nodes = 0
        """Compute nodes recorded so far: which node a clock reading was taken in (a hook that opens a span in one
        node must not close it in a later one)."""
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._origin = self._event()
            self._rss = None
            self.memory_at_start = int(torch.cuda.memory_allocated(device))
        else:
            self._rss = _ResidentSetSize()
            self._peak_rss = self.memory_at_start = self._rss()
        self.t0_unix = time.time()
        self._cpu0 = (time.thread_time(), time.process_time())

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def clock(self) -> Any:
        if self.cuda:
            return self._event()
        stamp = Stamp(time.time() - self.t0_unix)
        stamp.cpu = time.thread_time() - self._cpu0[0]
        return stamp

    def record(self, node: ScheduleNode, start: Any, end: Any, tensor: Any = None) -> None:
        nbytes = None  # a tuple of tensors went as consecutive messages: their bytes together
        if tensor is not None:
            nbytes = sum(t.numel() * t.element_size() for t in (tensor if isinstance(tensor, tuple) else (tensor,)))
        spans: tuple = ()
        if node.kind.is_compute:
            spans, self._inside = tuple(self._inside), []
            self.compute_nodes += 1
        self.events.append((node, start, end, nbytes, spans))
        if self._rss is not None and node.kind.is_compute:
            self._peak_rss = max(self._peak_rss, self._rss())

    def inside(self, part: str, start: Any, end: Any, share: float = 1.0) -> None:
        """A span (two :meth:`clock` readings) the running compute node spent in a ``part`` of the model:
        ``"layers"`` (its layer stack) or ``"ends"`` (the first stage's embedding); ``share`` of it
        where one call served several parts. A backend that knows the model reports them (the Megatron
        binder's :mod:`~primuspipe.backends.megatron.layer_timing`) and the node's event carries their
        sums (``TimedNode.layers`` / ``TimedNode.ends``): how calibration tells a chunk's fixed cost from
        its per-layer cost."""
        self._inside.append((part, start, end, share))

    def _timed(self, node: ScheduleNode, start: Any, end: Any, nbytes: int | None, spans: tuple) -> TimedNode:
        """An event in seconds from the step start (CUDA events must have completed)."""
        if self.cuda:
            inside = {part: (sum(a.elapsed_time(b) * share for p, a, b, share in spans if p == part) / 1e3, None)
                      for part in {p for p, *_ in spans}}
            return TimedNode(node, self._origin.elapsed_time(start) / 1e3, self._origin.elapsed_time(end) / 1e3,
                             bytes=nbytes, **inside)
        cpu = (start.cpu, end.cpu) if isinstance(start, Stamp) and isinstance(end, Stamp) else None
        inside = {}
        for part in {p for p, *_ in spans}:  # within the node's span by construction; clamp the last digits' noise
            mine = [(a, b, share) for p, a, b, share in spans if p == part]
            inside[part] = (min(float(end) - float(start), sum((float(b) - float(a)) * x for a, b, x in mine)),
                            min(cpu[1] - cpu[0], sum((b.cpu - a.cpu) * x for a, b, x in mine)) if cpu else None)
        return TimedNode(node, float(start), float(end), cpu, nbytes, **inside)

    def peak_memory_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(self._peak_rss, self._rss())

    def timeline(self, table: ScheduleTable, rank: int, iteration: int) -> Timeline:
        """The step's timeline; on GPU this is where the device is synchronised, once."""
        thread_cpu, process_cpu = time.thread_time() - self._cpu0[0], time.process_time() - self._cpu0[1]
        if self.cuda:
            torch.cuda.synchronize(self.device)
        events = tuple(sorted((self._timed(*e) for e in self.events), key=lambda e: (e.start, e.end)))
        peak = self.peak_memory_bytes()
        meta = {"t0_unix": self.t0_unix, "run_id": self.run_id, "device": str(self.device),
                "memory": "peak allocated" if self.cuda else "peak RSS",
                "placement": table.placement.to_dict(), "host": socket.gethostname(),
                "cpus": usable_cpus(), "threads": torch.get_num_threads(), "memory_at_start": self.memory_at_start}
        if self._rss is not None:
            self._rss.close()
            meta.update(thread_cpu=thread_cpu, process_cpu=process_cpu)
        return Timeline(
            source="run", algorithm=table.algorithm, pp=table.pp, vpp=table.vpp, microbatches=table.microbatches,
            ranks=(RankTimeline(rank, events, peak),), iteration=iteration, meta=meta,
        )


def shared_run_id(group: Any) -> str:
    """An id for this run of the pipeline ``group``, the same on all its ranks: each rank offers a fresh
    one to the default store and the first offer wins (no collective, so no rank waits on another).
    A torchrun restart (``TORCHELASTIC_RESTART_COUNT``) is a new run."""
    from primuspipe.runtime.liveness import default_store

    mine = uuid.uuid4().hex[:12]
    store = default_store()
    if store is None:
        return mine
    first = dist.get_process_group_ranks(group)[0]
    key = f"primuspipe/run_id/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{first}"
    return store.compare_set(key, "", mine).decode()
