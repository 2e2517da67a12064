"""Point-to-point transport for the runner: non-blocking sends and receives, and a hang watchdog that
never makes the host wait for the device.

Semantics are the ones the validator proves deadlock-free (see :mod:`primuspipe.passes.validation`):
posting never blocks; per direction (this rank -> peer) messages are matched in posting order, across
kinds. Every message between a pair goes through one channel (one process group, one tag) on purpose:
that is how NCCL/RCCL match point-to-point messages (they ignore tags), so a table that is safe here is
safe there, and the order the table gives is the only thing that keeps an activation apart from a
gradient when both neighbours are the same rank (docs/design.md §3). Ops are never batched
(``batch_isend_irecv`` may reorder them on gloo).

**The watchdog** gives every transfer a deadline: its posting time plus ``timeout_s``. Past it the
transfer raises :class:`~primuspipe.errors.PipelineHangError` naming this pipeline rank, the node (e.g.
``RECV_F3.0<0``), the peer, and the ranks that look dead or stopped (below). How a request is completed
depends on who completes it:

* **NCCL** (and any backend whose ``Work.wait()`` orders the device stream instead of blocking):
  :meth:`P2PTransport.complete` calls ``wait()`` on the main thread, which only makes the compute stream
  wait for the transfer, so the host keeps running ahead of the GPU. A monitor thread (one per process
  group, :class:`TransferWatchdog`) polls the in-flight requests' ``is_completed()``; one still pending
  past its deadline is reported (logged at once, with the names above) and the group is aborted, so the
  kernels and any host synchronisation waiting on it fail instead of hanging; the next call into the
  transport raises the error.
* **gloo** completes a request only inside ``wait`` on the calling thread, so there ``complete`` waits
  with the time left until the deadline. A gloo failure (e.g. "connection closed by peer") raises the
  same error, with the original message.

**Liveness** (:class:`PeerLiveness`): the monitor thread also writes a heartbeat for its rank into the
default process group's store every ``timeout_s / 10`` (at most every 10 s). The thread beats while the
main thread waits, so a rank that merely waits on a stuck peer stays alive, while a dead (SIGKILL) or
stopped (SIGSTOP) process stops beating. Every hang or failure report names the ranks of the pipeline
group that have not beaten for ``timeout_s / 2``: in a cascade -- rank 0 waits on rank 1, which waits on
a stopped rank 2 -- both rank 0 and rank 1 name rank 2.

``timeout_s`` of ``0`` turns the watchdog off: requests are completed with a plain ``wait()`` and
nothing is monitored.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from primuspipe.errors import PipelineHangError
from primuspipe.ir.node import ScheduleNode
from primuspipe.runtime.protocols import Pending

logger = logging.getLogger(__name__)

_HEARTBEAT_PREFIX = "primuspipe/heartbeat/"
_MAX_HEARTBEAT_S = 10.0
_MAX_POLL_S = 1.0


class PeerLiveness:
    """Heartbeats of the ranks of one process group, kept in the default store (wall-clock seconds, so
    clock skew between hosts must stay well below the staleness threshold)."""

    def __init__(self, group: Any, store: Any):
        self.store = store
        self.global_ranks: Sequence[int] = dist.get_process_group_ranks(group)
        self.me = dist.get_rank()

    @staticmethod
    def _key(global_rank: int) -> str:
        return f"{_HEARTBEAT_PREFIX}{global_rank}"

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


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class TransferWatchdog:
    """The deadlines of one process group's in-flight transfers, and the thread that watches them and
    beats for this rank. Shared by every :class:`P2PTransport` over the group (one per step)."""

    def __init__(self, group: Any, timeout_s: float, *, poll_completion: bool):
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.poll_completion = poll_completion
        """True where ``is_completed()`` tells the truth without ``wait`` (NCCL); gloo's only changes in ``wait``."""
        store = _default_store()
        self.liveness = PeerLiveness(group, store) if store is not None else None
        self.failure: PipelineHangError | None = None
        self._store_lost = False
        self._inflight: dict[int, tuple[Pending, float]] = {}
        self._lock = threading.Lock()
        self._interval_s = min(_MAX_HEARTBEAT_S, max(timeout_s / 10, 0.02))
        self._thread = threading.Thread(target=self._watch, name=f"primuspipe-watchdog-{self.rank}", daemon=True)
        self._beat()
        self._thread.start()

    def track(self, pending: Pending) -> float:
        """Register a posted request; returns its deadline (``time.monotonic()`` seconds)."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self._inflight[id(pending)] = (pending, deadline)
        return deadline

    def deadline(self, pending: Pending) -> float:
        with self._lock:
            return self._inflight[id(pending)][1]

    def untrack(self, pending: Pending) -> None:
        with self._lock:
            self._inflight.pop(id(pending), None)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def report(self, pending: Pending, cause: Exception | None) -> PipelineHangError:
        """The error for ``pending``: timed out (``cause`` None or a timeout) or failed (``cause``)."""
        node = pending.node
        what = "send to" if node.kind.is_send else "receive from"
        if cause is None or "timeout" in str(cause).lower() or "timed out" in str(cause).lower():
            how = f"did not complete within {self.timeout_s:g} s"
            hint = "The peer is stuck, dead or runs a different schedule; raise watchdog_timeout_s if it is merely slow."
        else:
            how = f"failed ({cause})"
            hint = "The peer's process probably died; look at its log first."
        return PipelineHangError(
            f"pipeline rank {self.rank}: {node} ({what} pipeline rank {node.peer}) {how}.{self._suspects()} {hint}")

    def _suspects(self) -> str:
        if self.liveness is None:
            return ""
        try:
            silent = self.liveness.unresponsive(self.timeout_s / 2)
        except Exception:  # noqa: BLE001 - the store may be gone with the peers; the report must still go out
            return ""
        if not silent:
            return " Every other pipeline rank is alive (it beats), so the wait is on a live rank."
        names = ", ".join(f"pipeline rank {r} ({'no heartbeat yet' if s is None else f'silent for {s:.0f} s'})"
                          for r, s in silent)
        return f" Not responding (dead or stopped): {names}."

    def _beat(self) -> None:
        if self.liveness is not None:
            try:
                self.liveness.beat()
            except Exception:  # noqa: BLE001 - the store went away (process group destroyed): stop beating
                self.liveness = None
                self._store_lost = True

    def _watch(self) -> None:
        next_beat = time.monotonic()
        while self.failure is None and not (self._store_lost and not self._inflight):
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + self._interval_s
            if self.poll_completion:
                self._sweep(now)
            time.sleep(min(self._interval_s, _MAX_POLL_S))

    def _sweep(self, now: float) -> None:
        with self._lock:
            entries = list(self._inflight.items())
        for key, (pending, deadline) in entries:
            if all(work.is_completed() for work in pending.work):
                with self._lock:
                    self._inflight.pop(key, None)
            elif now > deadline:
                self.failure = self.report(pending, None)
                logger.error("%s", self.failure)
                try:
                    self.group.abort()  # whatever waits on this group fails instead of hanging
                except Exception as exc:  # noqa: BLE001
                    logger.error("primuspipe watchdog: could not abort the process group: %s", exc)
                return


_watchdogs: "weakref.WeakKeyDictionary[Any, TransferWatchdog]" = weakref.WeakKeyDictionary()


def watchdog_for(group: Any, timeout_s: float) -> TransferWatchdog:
    """The process group's watchdog (one monitor thread per group and timeout, started on first use)."""
    watchdog = _watchdogs.get(group)
    if watchdog is None or watchdog.timeout_s != timeout_s or watchdog.failure is not None:
        watchdog = TransferWatchdog(group, timeout_s, poll_completion=dist.get_backend(group) != "gloo")
        _watchdogs[group] = watchdog
    return watchdog


class P2PTransport:
    """torch.distributed point-to-point over one process group (peers are ranks *in* that group)."""

    def __init__(self, group: Any, *, timeout_s: float):
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout_s = float(timeout_s)
        self._global = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self.watchdog = watchdog_for(group, self.timeout_s) if self.timeout_s > 0 else None

    def isend(self, node: ScheduleNode, tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> Pending:
        self._check()
        # Send an alias, not the tensor itself: a caller may then swap the tensor's storage (Megatron's
        # deallocate_output_tensor) while the transfer still reads the old one, which the alias keeps alive.
        # A tuple of tensors goes as consecutive messages, one request each.
        aliases = tuple(t.detach() for t in tensor) if isinstance(tensor, tuple) else tensor.detach()
        works = [dist.isend(a, dst=self._global[node.peer], group=self.group) for a in _each(aliases)]
        return self._track(Pending(node, aliases, works))

    def irecv(self, node: ScheduleNode, buffer: torch.Tensor | tuple[torch.Tensor, ...]) -> Pending:
        self._check()
        works = [dist.irecv(b, src=self._global[node.peer], group=self.group) for b in _each(buffer)]
        return self._track(Pending(node, buffer, works))

    def _check(self) -> None:
        if self.watchdog is not None:
            self.watchdog.raise_if_failed()

    def _track(self, pending: Pending) -> Pending:
        if self.watchdog is not None:
            self.watchdog.track(pending)
        return pending

    def complete(self, pending: Pending) -> None:
        """Complete the request: stream-ordered where the backend allows (never blocks the host), else
        (gloo) waiting at most until the request's deadline."""
        watchdog = self.watchdog
        if watchdog is None:
            for work in pending.work:
                work.wait()
            return
        self._check()
        if watchdog.poll_completion:
            for work in pending.work:
                work.wait()  # the monitor thread sees it complete (or not)
            return
        try:
            for work in pending.work:
                remaining = watchdog.deadline(pending) - time.monotonic()
                work.wait(timedelta(seconds=max(remaining, 1e-3)))
        except RuntimeError as exc:
            raise watchdog.report(pending, exc) from exc
        finally:
            watchdog.untrack(pending)


def _each(tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tensor if isinstance(tensor, tuple) else (tensor,)
