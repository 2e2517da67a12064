"""A minimal fork-based gloo launcher for runner tests that need no Megatron.

``run_ranks(fn, world_size, timeout_s)`` calls ``fn(rank, world_size)`` in ``world_size`` forked
processes joined by a gloo process group (FileStore, no ports) and returns the results by rank; a
rank's exception is re-raised in the parent as ``RankFailed`` carrying the traceback text.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    pass


def _worker(fn, rank, world_size, store_path, conn):
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        try:
            payload = ("ok", fn(rank, world_size))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        payload = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(payload))
    conn.close()


def run_ranks(fn, world_size: int, timeout_s: float = 60.0) -> list:
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="pp-runner-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, readers = [], []
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(fn, rank, world_size, store_path, writer), daemon=True)
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        try:
            results = []
            for rank, reader in enumerate(readers):
                if not reader.poll(timeout_s):
                    raise RankFailed(f"rank {rank} sent nothing within {timeout_s} s")
                status, value = pickle.loads(reader.recv_bytes())
                if status == "error":
                    raise RankFailed(f"rank {rank} failed:\n{value}")
                results.append(value)
            return results
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
