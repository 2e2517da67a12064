"""Run a function on N local CPU processes joined by a gloo process group.

This is how a schedule runs without a cluster: the runner's tests, the Megatron CPU-mode harness
(:mod:`primuspipe.testing.megatron.distributed_cpu`) and anyone debugging a table on a laptop start
their ranks here. Each process gets one thread (N ranks share a few cores) and a private
``FileStore`` (no port to race for); results come back to the parent through pipes.

A distributed hang must never block the caller: the parent waits at most ``timeout_s`` for all
ranks, fails fast on the first rank that raises or dies (:class:`WorkerError`, with its traceback),
and kills whatever is left; a run past the deadline raises
:class:`~primuspipe.errors.PipelineHangError` naming the ranks that did not finish.

With ``start_method="fork"`` (the default) whatever the parent imported (torch, megatron) is inherited,
so a launch costs about a second and ``fn`` may be any callable, closures included; with ``"spawn"``
``fn`` must be importable by name.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from primuspipe.errors import ConfigError, PipelineHangError, PrimusPipeError
from primuspipe.runtime import nccl_emulation

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerError(PrimusPipeError):
    """A worker process raised or died; ``rank`` and the worker's ``traceback`` say where."""

    def __init__(self, rank: int, details: str):
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.traceback = details


def run_gloo(
    fn: Callable[[int, int], T], world_size: int, *, timeout_s: float = 120.0, start_method: str = "fork"
) -> list[T]:
    """Call ``fn(rank, world_size)`` in ``world_size`` gloo-joined processes; results by rank.

    ``fn``'s result must be picklable (tensors are fine).
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ConfigError(f"start method {start_method!r} is not available on this platform")
    mp = multiprocessing.get_context(start_method)
    logger.debug("launching %d gloo ranks (%s)", world_size, start_method)
    store_dir = tempfile.mkdtemp(prefix="primuspipe-gloo-")
    store_path = os.path.join(store_dir, "store")
    processes, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = mp.Pipe(duplex=False)
            proc = mp.Process(target=_worker, args=(fn, rank, world_size, store_path, timeout_s, writer),
                              name=f"primuspipe-gloo-{rank}", daemon=True)
            proc.start()
            writer.close()
            processes.append(proc)
            readers.append(reader)
        return _collect(processes, readers, time.monotonic() + timeout_s, timeout_s)
    finally:
        _stop(processes)
        for reader in readers:
            reader.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _worker(fn: Callable[[int, int], Any], rank: int, world_size: int, store_path: str, timeout_s: float,
            conn: multiprocessing.connection.Connection) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(nccl_emulation.cpu_backend(), store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            payload = ("ok", fn(rank, world_size))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except Exception:  # noqa: BLE001
        data = pickle.dumps(("error", "result is not picklable:\n" + traceback.format_exc()))
    conn.send_bytes(data)
    conn.close()


def _stop(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _collect(processes: list[multiprocessing.process.BaseProcess],
             readers: list[multiprocessing.connection.Connection], deadline: float, timeout_s: float) -> list:
    """Gather one message per rank; fail fast on the first error, death or the deadline."""
    results: dict[int, Any] = {}
    waiting = dict(enumerate(readers))
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PipelineHangError(f"ranks {sorted(waiting)} did not finish within {timeout_s:.0f} s (killed)")
        rank_of: dict[Any, int] = {}
        for rank, reader in waiting.items():
            rank_of[reader] = rank
            rank_of[processes[rank].sentinel] = rank
        for item in multiprocessing.connection.wait(list(rank_of), remaining):
            rank = rank_of[item]
            if rank not in waiting:
                continue  # both its pipe and its sentinel were ready
            reader = waiting[rank]
            if not reader.poll():
                # The process ended; give a message still in flight a moment to land.
                processes[rank].join(timeout=1.0)
                if not reader.poll(1.0):
                    raise WorkerError(rank, f"process exited with code {processes[rank].exitcode}")
            status, value = pickle.loads(reader.recv_bytes())
            del waiting[rank]
            if status == "error":
                raise WorkerError(rank, value)
            results[rank] = value
    return [results[rank] for rank in range(len(processes))]
