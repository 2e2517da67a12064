"""The hang watchdog: every transfer has a deadline, and one past it is reported by name.

Every transfer's deadline is its posting time plus ``timeout_s``. Past it the transfer raises
:class:`~primuspipe.errors.PipelineHangError` naming this pipeline rank, the node (e.g. ``RECV_F3.0<0``),
the peer, and the ranks that look dead or stopped (:mod:`primuspipe.runtime.liveness`). How a request
is completed depends on who completes it:

* **NCCL** (and any backend whose ``Work.wait()`` orders the device stream instead of blocking):
  the transport calls ``wait()`` on the main thread, which only makes the compute stream wait for the
  transfer, so the host keeps running ahead of the GPU. A monitor thread (one per process group,
  :class:`TransferWatchdog`) polls the in-flight requests' ``is_completed()``; one still pending past
  its deadline is reported (logged at once, with the names above) and the group and its channels are
  aborted, so the kernels and any host synchronisation waiting on them fail instead of hanging; the
  next call into the transport raises the error.
* **gloo** (and the NCCL emulator, whose ``wait`` blocks the host) completes a request only inside
  ``wait`` on the calling thread, so there the transport waits with the time left until the deadline.
  A gloo failure (e.g. "connection closed by peer") raises the same error, with the original message.

``timeout_s`` of ``0`` turns the watchdog off: requests are completed with a plain ``wait()`` and
nothing is monitored.
"""

from __future__ import annotations

import atexit
import logging
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from primuspipe.errors import PipelineHangError
from primuspipe.runtime import nccl_emulation
from primuspipe.runtime.liveness import ENDED_UNREPORTED, PeerLiveness, default_store
from primuspipe.runtime.protocols import Pending
from primuspipe.runtime.termination import TerminationReporter

logger = logging.getLogger(__name__)

_MAX_HEARTBEAT_S = 10.0
_MAX_POLL_S = 1.0
_CAUSE_WAIT_S = 3.0
"""How long a rank waits for another rank's failure record before it reports: when stopped from
outside, or when a peer's connection closed (the peer may have failed and be writing its record)."""


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
        self._extra_aborts: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval_s = min(_MAX_HEARTBEAT_S, max(timeout_s / 10, 0.02))
        self._thread = threading.Thread(target=self._watch, name=f"primuspipe-watchdog-{self.rank}", daemon=True)
        self._beat()
        self._thread.start()
        TerminationReporter.install(_termination_reports)

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
        blamed = self._settled_causes(closed, lambda named: named.get(closed) != ENDED_UNREPORTED)
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
                for abort in self._aborts():
                    try:
                        abort()  # whatever waits on the group or its channels fails instead of hanging
                    except Exception as exc:  # noqa: BLE001 - one abort that fails must not stop the others
                        logger.error("primuspipe watchdog: could not abort the process group: %s", exc)
                return

    def on_abort(self, abort: Callable[[], None]) -> None:
        """Also call ``abort`` when a transfer is past its deadline (the transport's channels)."""
        if abort not in self._extra_aborts:
            self._extra_aborts.append(abort)

    def _aborts(self) -> list[Callable[[], None]]:
        group = self.group
        return ([group.abort] if group is not None else []) + self._extra_aborts


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


def _termination_reports(signum: int) -> list[str]:
    return [watchdog.termination_report(signum) for watchdog in list(_watchdogs.values())]


@atexit.register
def _stop_watchdogs() -> None:
    for watchdog in list(_watchdogs.values()):
        watchdog.stop()
    TerminationReporter.stop()


def _stream_ordered(group: Any) -> bool:
    """True where ``Work.wait()`` only orders the device stream (NCCL/RCCL and other device backends);
    gloo and the NCCL emulator block the host in it."""
    return dist.get_backend(group) not in ("gloo", nccl_emulation.BACKEND)


def watchdog_for(group: Any, timeout_s: float) -> TransferWatchdog:
    """The process group's watchdog (one monitor thread per group and timeout, started on first use)."""
    watchdog = _watchdogs.get(group)
    if watchdog is None or watchdog.timeout_s != timeout_s or watchdog.failure is not None:
        watchdog = TransferWatchdog(group, timeout_s, poll_completion=_stream_ordered(group))
        _watchdogs[group] = watchdog
    return watchdog
