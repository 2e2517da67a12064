"""Stopped from outside: a launcher's SIGTERM turned into each watchdog's report.

A launcher stops every rank once one has failed: torchrun sends SIGTERM to the others within a tenth of
a second, before most of them could notice anything. While a watchdog runs (and the process has no
SIGTERM handler of its own), SIGTERM prints the rank's report -- the node it waited on and the cause
from the records and heartbeats -- and exits with status 143; a watcher thread catches it even while
the main thread is blocked in a wait (``signal.set_wakeup_fd``).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any


class TerminationReporter:
    """Turns SIGTERM into each watchdog's report and exit status 143 (module docstring). Installed once
    per process, from the main thread, only where SIGTERM has its default action and no wakeup fd is
    set (the process's own handlers win)."""

    _pid: int | None = None
    _wake: tuple[socket.socket, socket.socket] | None = None
    _done = threading.Lock()
    _reports: Callable[[int], list[str]] = staticmethod(lambda signum: [])  # noqa: ARG005

    @classmethod
    def install(cls, reports: Callable[[int], list[str]]) -> None:
        """Report with ``reports(signum)`` (one line per watchdog) when SIGTERM arrives."""
        cls._reports = staticmethod(reports)
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
    def _forget_in_child(cls) -> None:
        """A forked child (a DataLoader worker, a test harness's rank) inherits the handler and the wakeup
        socket but not the listener: its SIGTERM would be written into the *parent's* socket and end the
        parent with status 143. The child gets the default SIGTERM back and a socket of its own."""
        if cls._wake is None or cls._pid == os.getpid():
            return
        try:
            if signal.getsignal(signal.SIGTERM) == cls._handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
        except ValueError:  # forked from a thread other than the main one: Python keeps no handlers there
            pass
        cls._pid, cls._wake = None, None

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
        lines = cls._reports(signum)
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


os.register_at_fork(after_in_child=TerminationReporter._forget_in_child)
