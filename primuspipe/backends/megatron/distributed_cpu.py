"""Run a function on N CPU processes joined by gloo, with Megatron's ``parallel_state`` set up.

Public API
----------
``ParallelLayout(pp, vpp=1, dp=1)``
    Frozen dataclass; ``world_size = pp * dp``. Invalid sizes raise :class:`ConfigError`.
``WorkerContext``
    What the function receives in each process: ``rank``, ``world_size``, ``layout``, ``pp_rank``,
    ``dp_rank``, ``seed``.
``run_on_gloo(fn, layout, *, seed=0, timeout_s=120.0, start_method="fork") -> list``
    Calls ``fn(ctx)`` on every rank and returns the results ordered by global rank. ``fn``'s result
    must be picklable (tensors are fine). A rank that raises makes the call raise
    :class:`WorkerError` with that rank's traceback; a run longer than ``timeout_s`` is killed and
    raises :class:`primuspipe.errors.PipelineHangError`.
``WorkerError``

Inside each worker, before ``fn``: ``torch.set_num_threads(1)`` (N ranks share a few cores),
:func:`enable_cpu_mode`, ``init_process_group("gloo")`` on a private ``FileStore`` (no port to race
for), ``initialize_model_parallel(pp, vpp)`` and :func:`cpu_rng_seed`. After ``fn``, in every case:
``destroy_model_parallel`` and ``destroy_process_group``.

Why fork
--------
Importing megatron costs seconds per process; with ``start_method="fork"`` the parent imports it once
(``enable_cpu_mode`` runs in the parent first) and each launch costs about a second. ``fn`` may then be
any callable, closures included. ``"spawn"`` is available for hosts where forking a process that has
imported torch is unsafe; ``fn`` must then be importable by name.
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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch

from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed, enable_cpu_mode
from primuspipe.errors import ConfigError, PipelineHangError, PrimusPipeError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerError(PrimusPipeError):
    """A worker process raised or died; ``rank`` and the worker's ``traceback`` say where."""

    def __init__(self, rank: int, details: str):
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.traceback = details


@dataclass(frozen=True)
class ParallelLayout:
    """Process grid of one run (tensor parallelism is always 1 here)."""

    pp: int
    """Pipeline-parallel size."""
    vpp: int = 1
    """Model chunks per pipeline rank (1 = no interleaving)."""
    dp: int = 1
    """Data-parallel size."""

    def __post_init__(self) -> None:
        for name in ("pp", "vpp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("vpp > 1 needs pp > 1 (Megatron has no interleaving without pipelining)")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


@dataclass(frozen=True)
class WorkerContext:
    """Where the current worker sits; ``pp_rank``/``dp_rank`` come from Megatron's parallel_state."""

    rank: int
    world_size: int
    layout: ParallelLayout
    pp_rank: int
    dp_rank: int
    seed: int


def _worker(
    fn: Callable[[WorkerContext], Any],
    rank: int,
    layout: ParallelLayout,
    store_path: str,
    seed: int,
    timeout_s: float,
    conn: multiprocessing.connection.Connection,
) -> None:
    try:
        torch.set_num_threads(1)
        enable_cpu_mode()
        from megatron.core import parallel_state

        store = torch.distributed.FileStore(store_path, layout.world_size)
        torch.distributed.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=layout.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1,
                pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            )
            cpu_rng_seed(seed)
            ctx = WorkerContext(
                rank=rank,
                world_size=layout.world_size,
                layout=layout,
                pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                dp_rank=parallel_state.get_data_parallel_rank(),
                seed=seed,
            )
            payload = ("ok", fn(ctx))
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
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


def run_on_gloo(
    fn: Callable[[WorkerContext], T],
    layout: ParallelLayout,
    *,
    seed: int = 0,
    timeout_s: float = 120.0,
    start_method: str = "fork",
) -> list[T]:
    """Run ``fn`` on ``layout.world_size`` gloo ranks; return each rank's result, by global rank."""
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ConfigError(f"start method {start_method!r} is not available on this platform")
    if start_method == "fork":
        enable_cpu_mode()  # import megatron once, here, so children inherit it
    mp = multiprocessing.get_context(start_method)
    logger.debug("launching %d gloo ranks (%s, %s)", layout.world_size, layout, start_method)
    store_dir = tempfile.mkdtemp(prefix="primuspipe-gloo-")
    store_path = os.path.join(store_dir, "store")
    processes, readers = [], []
    try:
        for rank in range(layout.world_size):
            reader, writer = mp.Pipe(duplex=False)
            proc = mp.Process(
                target=_worker,
                args=(fn, rank, layout, store_path, seed, timeout_s, writer),
                name=f"primuspipe-gloo-{rank}",
                daemon=True,
            )
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


def _collect(
    processes: list[multiprocessing.process.BaseProcess],
    readers: list[multiprocessing.connection.Connection],
    deadline: float,
    timeout_s: float,
) -> list:
    """Gather one message per rank; fail fast on the first error, death or the deadline."""
    results: dict[int, Any] = {}
    waiting = dict(enumerate(readers))
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PipelineHangError(
                f"ranks {sorted(waiting)} did not finish within {timeout_s:.0f} s (killed)"
            )
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
