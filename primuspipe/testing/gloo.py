"""Run a function on N local CPU processes joined by a gloo process group.

This is how a schedule runs without a cluster: the runner's tests, the Megatron CPU-mode harness
(:mod:`primuspipe.testing.megatron.distributed_cpu`) and anyone debugging a table on a laptop start
their ranks here. Each process gets one thread (N ranks share a few cores) and a private
``FileStore`` (no port to race for); results come back to the parent through pipes.

A distributed hang must never block the caller: the parent waits at most ``timeout_s`` for all
ranks, fails fast on the first rank that raises or dies (:class:`WorkerError`, with its traceback),
and kills whatever is left; a run past the deadline raises
:class:`~primuspipe.errors.PipelineHangError` naming the ranks that did not finish.

A rank that dies without a word (a native crash: ``malloc(): ...`` and SIGABRT, a segfault, the OOM
killer) leaves only its stderr, so each rank writes its stderr to a file of its own, with Python's
fault handler on (every thread's stack on a fatal signal) and glibc's fatal messages sent there rather
than to a terminal. The error names the rank, the signal and the end of that stderr (its stack dump
shortened to the innermost frames of each thread); a rank that failed only because a peer's
connection closed is not blamed while that peer lies dead. Every rank's stderr is written to the
caller's stderr afterwards, each line marked with its rank, so nothing a rank printed is lost.

With ``start_method="fork"`` (the default) whatever the parent imported (torch, megatron) is inherited,
so a launch costs about a second and ``fn`` may be any callable, closures included; with ``"spawn"``
``fn`` must be importable by name.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import sys
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
    stderr_paths = [os.path.join(store_dir, f"rank{rank}.stderr") for rank in range(world_size)]
    processes, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = mp.Pipe(duplex=False)
            proc = mp.Process(target=_worker,
                              args=(fn, rank, world_size, store_path, stderr_paths[rank], timeout_s, writer),
                              name=f"primuspipe-gloo-{rank}", daemon=True)
            proc.start()
            writer.close()
            processes.append(proc)
            readers.append(reader)
        return _collect(processes, readers, stderr_paths, time.monotonic() + timeout_s, timeout_s)
    finally:
        _stop(processes)
        for reader in readers:
            reader.close()
        _replay_stderr(stderr_paths)
        shutil.rmtree(store_dir, ignore_errors=True)


def _worker(fn: Callable[[int, int], Any], rank: int, world_size: int, store_path: str, stderr_path: str,
            timeout_s: float, conn: multiprocessing.connection.Connection) -> None:
    _stderr_to(stderr_path)
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
    except Exception:  # noqa: BLE001 - whatever pickling raises, the parent must hear of the rank
        data = pickle.dumps(("error", "result is not picklable:\n" + traceback.format_exc()))
    conn.send_bytes(data)
    conn.close()


def _stderr_to(path: str) -> None:
    """This rank's stderr -- Python's, native code's, the fault handler's and glibc's -- into ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stderr from now on
    os.environ["LIBC_FATAL_STDERR_"] = "1"  # glibc's "malloc(): ..." goes to a terminal, if any, without it
    faulthandler.enable(sys.stderr, all_threads=True)


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
             readers: list[multiprocessing.connection.Connection], stderr_paths: list[str], deadline: float,
             timeout_s: float) -> list:
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
            # A process that ended has sent its message already (or never will: the pipe reads as closed).
            message = _message(waiting.pop(rank), processes[rank])
            if message is None or message[0] == "error":
                raise _blame(rank, message, processes, stderr_paths)
            results[rank] = message[1]
    return [results[rank] for rank in range(len(processes))]


def _message(reader: multiprocessing.connection.Connection, process: multiprocessing.process.BaseProcess
             ) -> tuple[str, Any] | None:
    """The rank's ``(status, value)``; None when it ended without one (it died)."""
    try:
        if reader.poll(1.0):
            return pickle.loads(reader.recv_bytes())
    except EOFError:
        pass
    process.join(timeout=1.0)
    return None


_DEATH_GRACE_S = 1.0
"""How long a failed rank's peers get to show whether one of them died first (a peer's death fails
the others' transfers, "connection closed by peer", often before the parent sees the death)."""


def _blame(rank: int, message: tuple[str, Any] | None, processes: list, stderr_paths: list[str]) -> WorkerError:
    """The error for the first rank seen failing -- or for a peer that died before it, the cause."""
    if message is not None:
        deadline = time.monotonic() + _DEATH_GRACE_S
        alive = {p.sentinel: p for r, p in enumerate(processes) if r != rank and p.exitcode is None}
        while alive and (left := deadline - time.monotonic()) > 0:
            for ended in multiprocessing.connection.wait(list(alive), left):
                alive.pop(ended).join(timeout=1.0)  # its files close a moment before its exit status is there
        dead = [r for r, p in enumerate(processes) if r != rank and p.exitcode is not None and p.exitcode < 0]
        if not dead:
            return WorkerError(rank, message[1])
        first_line = message[1].strip().splitlines()[-1]
        return WorkerError(dead[0], _death(processes[dead[0]], stderr_paths[dead[0]])
                           + f"\n(rank {rank} failed after it: {first_line})")
    return WorkerError(rank, _death(processes[rank], stderr_paths[rank]))


def _death(process: multiprocessing.process.BaseProcess, stderr_path: str) -> str:
    code = process.exitcode
    how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 and -code in
           signal.valid_signals() else f"exited with code {code}")
    tail = _stderr_tail(_read(stderr_path))
    return (f"process {how} before returning a result" +
            (f"; its stderr ends with:\n{tail}" if tail else " and wrote nothing to stderr"))


_TAIL_LINES = 40
_FRAMES_PER_THREAD = 4
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")


def _stderr_tail(text: str) -> str:
    """The last lines of a rank's stderr, a fault handler's stack dump cut to the innermost frames of
    each thread (it prints the innermost first) and without its list of extension modules."""
    lines, frames = [], None
    for line in text.splitlines():
        if _THREAD.match(line):
            frames = 0
        elif frames is not None and line.startswith("  File "):
            frames += 1
            if frames == _FRAMES_PER_THREAD + 1:
                lines.append("  ...")
            if frames > _FRAMES_PER_THREAD:
                continue
        elif line.startswith("Extension modules:"):
            continue
        else:
            frames = None
        lines.append(line)
    return "\n".join(lines[-_TAIL_LINES:])


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _replay_stderr(stderr_paths: list[str]) -> None:
    """Every rank's stderr to the caller's, each line marked with its rank."""
    for rank, path in enumerate(stderr_paths):
        text = _read(path)
        if text:
            sys.stderr.write("".join(f"[gloo rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()
