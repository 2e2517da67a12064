"""Which ranks of a pipeline are alive: heartbeats and failure records in the default store.

The watchdog's monitor thread writes a heartbeat for its rank into the default process group's store
every ``timeout_s / 10`` (at most every 10 s). The thread beats while the main thread waits, so a rank
that merely waits on a stuck peer stays alive, while a dead (SIGKILL) or stopped (SIGSTOP) process
stops beating. A rank that fails writes a *failure record* into the store before it raises: the ranks
it holds responsible. Every report names the cause, not the neighbour:

* ranks of the pipeline group silent for ``timeout_s / 2`` (stopped or dead);
* a peer whose connection closed (gloo's "connection closed by peer") without a record: it died, or
  failed outside primuspipe -- a SIGKILLed rank is named by its neighbours within milliseconds;
* the ranks named by the records of others: in a cascade -- rank 0 waits on rank 1, which waits on a
  stopped or dead rank 2, then exits -- rank 0 names rank 2, not rank 1.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

_HEARTBEAT_PREFIX = "primuspipe/{attempt}/heartbeat/"
_FAILURE_PREFIX = "primuspipe/{attempt}/failure/"
ENDED_UNREPORTED = "its process ended without reporting an error: it died or was killed"


def attempt() -> str:
    """torchrun's restart count: a restarted run keeps torchrun's store, so its keys carry it."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


class PeerLiveness:
    """Heartbeats of the ranks of one process group, kept in the default store (wall-clock seconds, so
    clock skew between hosts must stay well below the staleness threshold)."""

    def __init__(self, group: Any, store: Any):
        self.store = store
        self.global_ranks: Sequence[int] = dist.get_process_group_ranks(group)
        self.me = dist.get_rank()
        self.group_rank = list(self.global_ranks).index(self.me)
        self._heartbeat_prefix = _HEARTBEAT_PREFIX.format(attempt=attempt())
        self._failure_prefix = _FAILURE_PREFIX.format(attempt=attempt())

    def _key(self, global_rank: int) -> str:
        return f"{self._heartbeat_prefix}{global_rank}"

    def beat(self) -> None:
        self.store.set(self._key(self.me), repr(time.time()))

    def silent_for(self, global_rank: int) -> float | None:
        """Seconds since ``global_rank`` last beat (``None``: never)."""
        key = self._key(global_rank)
        if not self.store.check([key]):
            return None
        return max(0.0, time.time() - float(self.store.get(key).decode()))

    def unresponsive(self, threshold_s: float) -> list[tuple[int, float | None]]:
        """``(rank in the group, seconds silent or None)`` of every other rank silent past the threshold."""
        out = []
        for group_rank, global_rank in enumerate(self.global_ranks):
            if global_rank == self.me:
                continue
            silent = self.silent_for(global_rank)
            if silent is None or silent > threshold_s:
                out.append((group_rank, silent))
        return out

    def record_failure(self, blamed: dict[int, str]) -> None:
        """Say, before raising, which ranks of the group this rank holds responsible (group rank -> why)."""
        self.store.set(f"{self._failure_prefix}{self.me}", json.dumps({str(r): why for r, why in blamed.items()}))

    def failure_records(self) -> dict[int, dict[int, str]]:
        """The failure records of the group's other ranks: reporting group rank -> {blamed group rank: why}."""
        out = {}
        for group_rank, global_rank in enumerate(self.global_ranks):
            key = f"{self._failure_prefix}{global_rank}"
            if global_rank != self.me and self.store.check([key]):
                out[group_rank] = {int(r): why for r, why in json.loads(self.store.get(key).decode()).items()}
        return out

    def causes(self, threshold_s: float, closed_peer: int | None = None) -> dict[int, str]:
        """The ranks to blame (group rank -> why): ranks silent past ``threshold_s``, ``closed_peer`` when
        its connection closed without a failure record, and what the others' records name, followed
        to ranks that did not report themselves (rank 0 -> rank 1 -> rank 2 names rank 2)."""
        records = self.failure_records()
        blamed: dict[int, str] = {}
        if closed_peer is not None and closed_peer not in records:
            blamed[closed_peer] = ENDED_UNREPORTED
        for reporter, named in sorted(records.items()):
            for rank, why in named.items():
                if rank not in records and rank != self.group_rank:
                    blamed.setdefault(rank, f"{why}; reported by pipeline rank {reporter}")
        for rank, silent in self.unresponsive(threshold_s):
            if rank not in records:
                blamed.setdefault(rank, "no heartbeat yet" if silent is None else f"silent for {silent:.0f} s")
        return blamed


def default_store() -> Any:
    """The default process group's store (heartbeats, failure records, the dump run id); None if none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
