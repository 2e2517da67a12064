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
stopped (SIGSTOP) process stops beating. A rank that fails writes a *failure record* into the store
before it raises: the ranks it holds responsible. Every report names the cause, not the neighbour:

* ranks of the pipeline group silent for ``timeout_s / 2`` (stopped or dead);
* a peer whose connection closed (gloo's "connection closed by peer") without a record: it died, or
  failed outside primuspipe -- a SIGKILLed rank is named by its neighbours within milliseconds;
* the ranks named by the records of others: in a cascade -- rank 0 waits on rank 1, which waits on a
  stopped or dead rank 2, then exits -- rank 0 names rank 2, not rank 1.

**Stopped from outside.** A launcher stops every rank once one has failed: torchrun sends SIGTERM to
the others within a tenth of a second, before most of them could notice anything. While a watchdog
runs (and the process has no SIGTERM handler of its own), SIGTERM prints the rank's report -- the node
it waited on and the cause from the records and heartbeats -- and exits with status 143; a watcher
thread catches it even while the main thread is blocked in a wait (``signal.set_wakeup_fd``).

``timeout_s`` of ``0`` turns the watchdog off: requests are completed with a plain ``wait()`` and
nothing is monitored.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from primuspipe.errors import PipelineHangError
from primuspipe.ir.node import ScheduleNode
from primuspipe.runtime.protocols import Pending

logger = logging.getLogger(__name__)

_HEARTBEAT_PREFIX = "primuspipe/{attempt}/heartbeat/"
_FAILURE_PREFIX = "primuspipe/{attempt}/failure/"
_MAX_HEARTBEAT_S = 10.0
_MAX_POLL_S = 1.0
_CAUSE_WAIT_S = 3.0
"""How long a rank waits for another rank's failure record before it reports: when stopped from
outside, or when a peer's connection closed (the peer may have failed and be writing its record)."""
_ENDED_UNREPORTED = "its process ended without reporting an error: it died or was killed"


class PeerLiveness:
    """Heartbeats of the ranks of one process group, kept in the default store (wall-clock seconds, so
    clock skew between hosts must stay well below the staleness threshold)."""

    def __init__(self, group: Any, store: Any):
        self.store = store
        self.global_ranks: Sequence[int] = dist.get_process_group_ranks(group)
        self.me = dist.get_rank()
        self.group_rank = list(self.global_ranks).index(self.me)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted run keeps torchrun's store
        self._heartbeat_prefix = _HEARTBEAT_PREFIX.format(attempt=attempt)
        self._failure_prefix = _FAILURE_PREFIX.format(attempt=attempt)

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
            blamed[closed_peer] = _ENDED_UNREPORTED
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


class TransferWatchdog:
    """The deadlines of one process group's in-flight transfers, and the thread that watches them and
    beats for this rank. Shared by every :class:`P2PTransport` over the group (one per step)."""

    def __init__(self, group: Any, timeout_s: float, *, poll_completion: bool):
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.poll_completion = poll_completion
        """True where ``is_completed()`` tells the truth without ``wait`` (NCCL); gloo's only changes in ``wait``."""
        store = default_store()
        self.liveness = PeerLiveness(group, store) if store is not None else None
        self.failure: PipelineHangError | None = None
        self._store_lost = False
        self._inflight: dict[int, tuple[Pending, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval_s = min(_MAX_HEARTBEAT_S, max(timeout_s / 10, 0.02))
        self._thread = threading.Thread(target=self._watch, name=f"primuspipe-watchdog-{self.rank}", daemon=True)
        self._beat()
        self._thread.start()
        _TerminationReporter.install()

    @property
    def group(self) -> Any:
        """The process group, held weakly: a watchdog (kept in a module-level map) that held it would keep
        the group and its gloo worker threads alive past ``destroy_process_group`` into the interpreter's
        exit, where a worker finishing a request needs the GIL and aborts the process."""
        return self._group()

    @group.setter
    def group(self, group: Any) -> None:
        self._group = weakref.ref(group)

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
        """The error for ``pending``: timed out (``cause`` None or a timeout) or failed (``cause``). It
        names the ranks to blame and leaves this rank's failure record for the others."""
        node = pending.node
        what = "send to" if node.kind.is_send else "receive from"
        timed_out = cause is None or "timeout" in str(cause).lower() or "timed out" in str(cause).lower()
        if timed_out:
            how = f"did not complete within {self.timeout_s:g} s"
            hint = "The peer is stuck, dead or runs a different schedule; raise watchdog_timeout_s if it is merely slow."
        else:
            how = f"failed ({_backend_message(cause)})"
            hint = "Look at the log of the rank named first."
        closed = None if timed_out else node.peer
        # a peer whose connection closed may be a rank that failed itself and is writing its record now
        blamed = self._settled_causes(closed, lambda named: named.get(closed) != _ENDED_UNREPORTED)
        if blamed and self.liveness is not None:
            try:
                self.liveness.record_failure(blamed)
            except Exception:  # noqa: BLE001 - the store may be gone; the report must still go out
                pass
        return PipelineHangError(
            f"pipeline rank {self.rank}: {node} ({what} pipeline rank {node.peer}) {how}.{_named(blamed)} {hint}")

    def _settled_causes(self, closed_peer: int | None, settled: Callable[[dict[int, str]], bool]
                        ) -> dict[int, str] | None:
        """:meth:`_causes`, asked again every 0.1 s for up to :data:`_CAUSE_WAIT_S` until ``settled``: a
        neighbour that saw the failure may be writing its record right now."""
        deadline = time.monotonic() + _CAUSE_WAIT_S
        blamed = self._causes(closed_peer)
        while blamed is not None and not settled(blamed) and time.monotonic() < deadline:
            time.sleep(0.1)
            blamed = self._causes(closed_peer)
        return blamed

    def _causes(self, closed_peer: int | None) -> dict[int, str] | None:
        """Ranks to blame (see :meth:`PeerLiveness.causes`); None when the store is unreachable."""
        if self.liveness is None:
            return None
        try:
            return self.liveness.causes(self.timeout_s / 2, closed_peer)
        except Exception:  # noqa: BLE001 - the store may be gone with the peers
            return None

    def termination_report(self, signum: int) -> str:
        """What this rank says when stopped from outside: the node it waited on and the cause."""
        with self._lock:
            waiting = [p.node for p, _ in self._inflight.values()]
        blamed = self._settled_causes(None, bool)
        at = f" while {waiting[0]} waited on pipeline rank {waiting[0].peer}" if waiting else ""
        return (f"pipeline rank {self.rank}: stopped from outside ({signal.Signals(signum).name}; a launcher such as "
                f"torchrun stops every rank once one has failed){at}.{_named(blamed)}")

    def _beat(self) -> None:
        if self.liveness is not None:
            try:
                self.liveness.beat()
            except Exception:  # noqa: BLE001 - the store went away (process group destroyed): stop beating
                self.liveness = None
                self._store_lost = True

    def _watching(self) -> bool:
        """Until stopped, a failure, or the end of the process group (destroyed, or its store gone with
        nothing in flight): past it there is nothing to watch and no one to beat for."""
        return (self.failure is None and not self._stop.is_set() and not (self._store_lost and not self._inflight)
                and dist.is_initialized() and self.group is not None)

    def _watch(self) -> None:
        next_beat = time.monotonic()
        while self._watching():
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + self._interval_s
            if self.poll_completion:
                self._sweep(now)
            self._stop.wait(min(self._interval_s, _MAX_POLL_S))

    def stop(self) -> None:
        """End the monitor thread (at exit: a daemon thread must not be inside the store's C++ client
        when the interpreter finalizes, which aborts the process)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

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
                    group = self.group
                    if group is not None:
                        group.abort()  # whatever waits on this group fails instead of hanging
                except Exception as exc:  # noqa: BLE001
                    logger.error("primuspipe watchdog: could not abort the process group: %s", exc)
                return


_watchdogs: "weakref.WeakKeyDictionary[Any, TransferWatchdog]" = weakref.WeakKeyDictionary()


def _backend_message(cause: Exception) -> str:
    """gloo's error on one line, without its source location and generic advice (the report gives better)."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(cause).split()))
    return text.split(" This is typically caused by")[0].rstrip(".")


def _named(blamed: dict[int, str] | None) -> str:
    """The report's sentence naming the ranks to blame."""
    if blamed is None:
        return ""
    if not blamed:
        return " Every other pipeline rank is alive (it beats) and none reported a failure, so the wait is on a live rank."
    return " Not responding (dead or stopped): " + ", ".join(
        f"pipeline rank {r} ({why})" for r, why in sorted(blamed.items())) + "."


@atexit.register
def _stop_watchdogs() -> None:
    for watchdog in list(_watchdogs.values()):
        watchdog.stop()
    _TerminationReporter.stop()


class _TerminationReporter:
    """Turns SIGTERM into each watchdog's report and exit status 143 (module docstring). Installed once
    per process, from the main thread, only where SIGTERM has its default action and no wakeup fd is
    set (the process's own handlers win)."""

    _pid: int | None = None
    _wake: tuple[socket.socket, socket.socket] | None = None
    _done = threading.Lock()

    @classmethod
    def install(cls) -> None:
        if cls._pid == os.getpid() or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, cls._handler):
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        if signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False) not in (-1, cls._fd()):
            signal.set_wakeup_fd(-1)  # someone else's: put it back untouched
            reader.close()
            writer.close()
            return
        signal.signal(signal.SIGTERM, cls._handler)
        cls._pid, cls._wake = os.getpid(), (reader, writer)
        threading.Thread(target=cls._listen, args=(reader,), name="primuspipe-sigterm", daemon=True).start()

    @classmethod
    def _fd(cls) -> int:
        return cls._wake[1].fileno() if cls._wake is not None else -1

    @classmethod
    def _listen(cls, reader: socket.socket) -> None:
        while True:
            select.select([reader], [], [])
            data = reader.recv(64)
            if not data or 0 in data:
                return  # stopped at exit
            if signal.SIGTERM in data:
                cls._report_and_exit(signal.SIGTERM)

    @classmethod
    def _handler(cls, signum: int, frame: Any) -> None:  # noqa: ARG003 - signal's signature
        cls._report_and_exit(signum)

    @classmethod
    def _report_and_exit(cls, signum: int) -> None:
        if not cls._done.acquire(blocking=False):
            return  # the other path is reporting
        lines = [w.termination_report(signum) for w in list(_watchdogs.values())]
        sys.stderr.write("".join(f"{line}\n" for line in lines) or
                         f"primuspipe: stopped from outside ({signal.Signals(signum).name})\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    @classmethod
    def stop(cls) -> None:
        if cls._pid == os.getpid() and cls._wake is not None:
            try:
                cls._wake[1].send(b"\0")
            except OSError:
                pass


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
        peer = self._global[node.peer]
        works = self._post(node, lambda: [dist.isend(a, dst=peer, group=self.group) for a in _each(aliases)])
        return self._track(Pending(node, aliases, works))

    def irecv(self, node: ScheduleNode, buffer: torch.Tensor | tuple[torch.Tensor, ...]) -> Pending:
        self._check()
        peer = self._global[node.peer]
        works = self._post(node, lambda: [dist.irecv(b, src=peer, group=self.group) for b in _each(buffer)])
        return self._track(Pending(node, buffer, works))

    def _post(self, node: ScheduleNode, post: Any) -> list:
        """Post the requests; a backend that refuses (gloo, once the peer's connection closed) is reported
        like a failed transfer."""
        try:
            return post()
        except RuntimeError as exc:
            if self.watchdog is None:
                raise
            raise self.watchdog.report(Pending(node, None, []), exc) from exc

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
            deadline = watchdog.deadline(pending)
            for work in pending.work:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as exc:
            raise watchdog.report(pending, exc) from exc
        finally:
            watchdog.untrack(pending)


def _each(tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tensor if isinstance(tensor, tuple) else (tensor,)
