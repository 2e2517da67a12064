"""An NCCL emulator for CPU runs: gloo underneath, NCCL's progress rules on top.

No multi-GPU machine is needed to find out whether a run would hang on NCCL/RCCL: set
``PRIMUSPIPE_NCCL_EMULATION=pair`` (lazy communicator init, torch's default) or ``=group`` (eager init,
a process group bound to a device) and every process group the run creates on the default backend is
an :class:`EmulatedNCCLGroup` -- a torch.distributed backend registered as ``primuspipe_nccl_emu``
that moves the bytes with gloo but lets operations progress only as NCCL lets them:

* **streams**: every operation goes to a stream, keyed as ``ProcessGroupNCCL`` keys its communicators
  and streams. Unbatched send/recv: the rank pair under ``pair`` (both directions share it), the group
  under ``group``. ``batch_isend_irecv`` batches and collectives: the group. A stream runs its items
  one after another, in posting order, on its own thread.
* **blocking**: a send or receive completes only once the peer's matching operation runs on the
  peer's stream (a rendezvous: the receiver acknowledges on a side tag; NCCL ignores tags, so a
  stream matches in order, whatever tag the caller gave). The ops of one batch (one
  ``ncclGroupStart``/``ncclGroupEnd``) progress together; the batch completes when all have.
* **lazy init** (``pair``): the first operation on a pair's stream blocks the *host* until the peer
  reaches its first operation on that stream (``ncclCommInitRank`` is collective over the pair); the
  first batch or collective on the group, likewise over the whole group.

The host blocks in ``Work.wait()``, where NCCL only makes the compute stream wait. For deadlocks that
is the same thing: ``ProcessGroupNCCL`` orders each operation after the compute stream's work at its
posting, so anything posted after a wait runs on the device after the waited-for operation completes,
as it does here. Operations on other process backends (the ``gloo`` groups Megatron creates on
purpose) are untouched.

The emulator is trusted because it agrees with NCCL both ways (tests/runtime/test_nccl_emulation.py):
Megatron's own 1F1B and interleaved schedules (``batch_p2p_comm`` on and off, ``overlap_p2p_comm``) and
torch.distributed.pipelining's schedules run under it, as they do on NCCL, while posting a table's
transfers unbatched on one group (primuspipe's transport before it kept one group per direction)
hangs under it exactly as :mod:`primuspipe.passes.streams` predicts for ``nccl-pair``. On generated
posting orders (tests/runtime/test_nccl_differential.py) it stops exactly the ranks the ``nccl-pair``,
``nccl-group`` and ``nccl-batched`` replays stop, at the operations they name.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from primuspipe.errors import ConfigError

BACKEND = "primuspipe_nccl_emu"
ENV = "PRIMUSPIPE_NCCL_EMULATION"
MODES = {
    "pair": "lazy communicator init (torch's default): unbatched send/recv of a rank pair on the pair's stream",
    "group": "eager init (process group bound to a device): unbatched send/recv on the group's one stream",
}
_TAGS_PER_STREAM = 3  # data, acknowledgement, communicator init


def mode() -> str | None:
    """The emulation mode ``PRIMUSPIPE_NCCL_EMULATION`` asks for (None: unset or empty)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in MODES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r} is not an emulation mode; use one of "
                          + ", ".join(f"{m} ({what})" for m, what in MODES.items()) + ", or leave it unset")
    return value


def cpu_backend() -> str:
    """The backend a CPU run initialises torch.distributed with: the emulator when asked for, else gloo."""
    return BACKEND if mode() else "gloo"


class EmulatedWork(dist._Work):
    """A request on an emulated stream: done when its stream has run it (module docstring)."""

    def __init__(self, tensors: Sequence[torch.Tensor], what: str):
        super().__init__()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._tensors = list(tensors)
        self._what = what
        self._future: torch.futures.Future = torch.futures.Future()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(self._tensors)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None or timeout == timedelta(0) else timeout.total_seconds()):
            raise RuntimeError(f"emulated NCCL {self._what} timed out after {timeout}: its stream did not reach it, "
                               "or the peer never ran the matching operation")
        if self._error is not None:
            raise RuntimeError(f"emulated NCCL {self._what} failed: {self._error}") from self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Any:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        return self._future


class _Stream:
    """One in-order stream: a thread that runs the items posted to it one after another."""

    def __init__(self, name: str):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, run: Callable[[], None], works: Sequence[EmulatedWork]) -> None:
        self._items.put((run, works))

    def close(self, timeout_s: float = 1.0) -> bool:
        """Stop after the items posted so far; True once the thread has ended."""
        self._items.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            run, works = item
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - the error belongs to the requests, raised at their wait
                for work in works:
                    work._finish(exc)
            else:
                for work in works:
                    work._finish()


class _P2P:
    """One send or receive of a batch or an unbatched request."""

    def __init__(self, send: bool, tensors: list[torch.Tensor], peer: int):
        self.send, self.tensors, self.peer = send, tensors, peer
        self.work = EmulatedWork(tensors, f"{'send to' if send else 'receive from'} group rank {peer}")


class EmulatedNCCLGroup(dist.ProcessGroup):
    """A process group with NCCL's progress rules over a gloo group (module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, emulation: str):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._mode = emulation
        self._timeout = timeout
        self._streams: dict[tuple, _Stream] = {}
        self._communicators: set[tuple] = set() if emulation == "pair" else {("group",)}
        self._batch: list[_P2P] | None = None
        self._lock = threading.Lock()
        _live.add(self)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def __repr__(self) -> str:
        return f"EmulatedNCCLGroup(mode={self._mode}, rank={self.rank()}, size={self.size()})"

    # -- streams -------------------------------------------------------------------------------------

    def _tag(self, key: tuple, which: int) -> int:
        base = 0 if key == ("group",) else 1 + key[1] * self.size() + key[2]
        return base * _TAGS_PER_STREAM + which

    def _stream(self, key: tuple) -> _Stream:
        with self._lock:
            if key not in self._streams:
                self._streams[key] = _Stream(f"nccl-emu-{'-'.join(map(str, key))}-r{self.rank()}")
            return self._streams[key]

    def _ensure_communicator(self, key: tuple) -> None:
        """Lazy init: the first use of a communicator blocks the host until its other ranks reach theirs."""
        if key in self._communicators:
            return
        if key == ("group",):
            self._gloo.barrier().wait()
        else:
            peer = key[1] if key[2] == self.rank() else key[2]
            token, echo = torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
            sent = self._gloo.send([token], peer, self._tag(key, 2))
            self._gloo.recv([echo], peer, self._tag(key, 2)).wait(self._timeout)
            sent.wait(self._timeout)
        self._communicators.add(key)

    def _post(self, key: tuple, run: Callable[[], None], works: Sequence[EmulatedWork]) -> None:
        self._ensure_communicator(key)
        self._stream(key).post(run, works)

    def _exchange(self, key: tuple, ops: list[_P2P]) -> Callable[[], None]:
        """What a stream runs for a batch (or one op): post every transfer at once, then complete each
        only once the peer's matching operation ran (the receiver's acknowledgement).

        A send's acknowledgement is awaited from the moment its batch runs, not after the batch's
        receives: gloo completes a send (the receiver's acknowledgement is one) only once its receive is
        posted, so a receiver would otherwise wait on the sender's *other* operations -- where NCCL
        completes a receive once its data is in, whatever else the sender's group still waits for."""
        data, ack = self._tag(key, 0), self._tag(key, 1)

        def run() -> None:
            posted = [(op, (self._gloo.send if op.send else self._gloo.recv)(op.tensors, op.peer, data),
                       self._gloo.recv([torch.zeros(1, dtype=torch.uint8)], op.peer, ack) if op.send else None)
                      for op in ops]
            acks = []
            for op, work, _ in posted:
                if not op.send:
                    work.wait()
                    acks.append(self._gloo.send([torch.ones(1, dtype=torch.uint8)], op.peer, ack))
            for op, work, acknowledged in posted:
                if op.send:
                    work.wait()
                    acknowledged.wait()
            for work in acks:
                work.wait()
        return run

    def _p2p(self, send: bool, tensors: list[torch.Tensor], peer: int) -> EmulatedWork:
        if peer == self.rank():
            raise RuntimeError("the NCCL emulator does not send to its own rank")
        op = _P2P(send, tensors, peer)
        if self._batch is not None:
            self._batch.append(op)
            return op.work
        key = ("group",) if self._mode == "group" else ("pair", min(peer, self.rank()), max(peer, self.rank()))
        self._post(key, self._exchange(key, [op]), [op.work])
        return op.work

    @contextmanager
    def batch(self):
        """One ``ncclGroupStart``/``ncclGroupEnd``: the ops posted inside progress together, on the group's
        stream (``batch_isend_irecv`` on this group runs inside one)."""
        assert self._batch is None, "batches do not nest"
        self._batch = []
        try:
            yield
            ops = self._batch
        finally:
            self._batch = None
        if ops:
            self._post(("group",), self._exchange(("group",), ops), [op.work for op in ops])

    # -- point-to-point ------------------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> EmulatedWork:  # noqa: ARG002 - NCCL ignores tags
        return self._p2p(True, tensors, dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> EmulatedWork:  # noqa: ARG002
        return self._p2p(False, tensors, src)

    # -- collectives: gloo's, run in order on the group's stream (the table below the class) ----------

    def _collective(self, name: str, tensors: Sequence[torch.Tensor], call: Callable[[], Any]) -> EmulatedWork:
        work = EmulatedWork(tensors, name)
        self._post(("group",), lambda: call().wait(), [work])
        return work

    def barrier(self, opts=None):
        opts = opts if opts is not None else c10d.BarrierOptions()
        return self._collective("barrier", [], lambda: self._gloo.barrier(opts))

    # NCCL fuses these into one group; gloo has no fused form, so they run one pair after another in one
    # stream item (the same order on every rank, which is all a collective needs)
    # (torch 2.13 calls them all_gather_single_coalesced / reduce_scatter_single_coalesced; older torch
    # the *_tensor_coalesced names)
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._collective("all_gather_single_coalesced", outputs, lambda: _Each(
            [self._gloo._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        return self._collective("reduce_scatter_single_coalesced", outputs, lambda: _Each(
            [self._gloo._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]))

    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def shutdown(self) -> None:
        """End the streams and release the gloo group while Python still runs: a gloo group left to the
        interpreter's exit aborts the process when its worker threads drop a request (they need the
        GIL). A stream stuck in a hang is left alone."""
        streams, self._streams = list(self._streams.values()), {}
        if all([stream.close() for stream in streams]):
            self._gloo = None

    def abort(self) -> None:
        self.shutdown()


class _Each:
    """Several gloo requests waited for as one."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


def _delegate(name: str, gloo_name: str, options: Callable[[], Any], arity: int, tensors_at: int) -> Callable:
    """A collective of gloo's (its ``gloo_name``), posted on the group's stream as ``name``: ``arity``
    arguments before the options, the request's tensors at ``tensors_at``."""
    def collective(self: EmulatedNCCLGroup, *args: Any) -> EmulatedWork:
        args = args if len(args) > arity else (*args, options())
        tensors = args[tensors_at]
        return self._collective(name, tensors if isinstance(tensors, list) else [tensors],
                                lambda: getattr(self._gloo, gloo_name)(*args))
    collective.__name__ = name
    return collective


# (ProcessGroup method, gloo's method, options, arity, tensors at): every collective torch.distributed
# calls on a group, under the names of the torch it runs with -- a method left out would fall through to
# ProcessGroup's device dispatch, which finds no backend for this Python group
for _name, _gloo_name, _options, _arity, _tensors_at in (
        ("allreduce", "allreduce", c10d.AllreduceOptions, 1, 0),
        ("allreduce_coalesced", "allreduce_coalesced", c10d.AllreduceCoalescedOptions, 1, 0),
        ("broadcast", "broadcast", c10d.BroadcastOptions, 1, 0), ("reduce", "reduce", c10d.ReduceOptions, 1, 0),
        ("allgather", "allgather", c10d.AllgatherOptions, 2, 1),
        ("allgather_coalesced", "allgather_coalesced", c10d.AllgatherOptions, 2, 1),
        ("_allgather_base", "_allgather_base", c10d.AllgatherOptions, 2, 0),
        ("all_gather_single", "_allgather_base", c10d.AllgatherOptions, 2, 0),
        ("reduce_scatter", "reduce_scatter", c10d.ReduceScatterOptions, 2, 0),
        ("_reduce_scatter_base", "_reduce_scatter_base", c10d.ReduceScatterOptions, 2, 0),
        ("reduce_scatter_single", "_reduce_scatter_base", c10d.ReduceScatterOptions, 2, 0),
        ("alltoall_base", "alltoall_base", c10d.AllToAllOptions, 4, 0),
        ("all_to_all_single", "alltoall_base", c10d.AllToAllOptions, 4, 0),
        ("alltoall", "alltoall", c10d.AllToAllOptions, 2, 0),
        ("gather", "gather", c10d.GatherOptions, 2, 1), ("scatter", "scatter", c10d.ScatterOptions, 2, 0)):
    setattr(EmulatedNCCLGroup, _name, _delegate(_name, _gloo_name, _options, _arity, _tensors_at))


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> EmulatedNCCLGroup:
    emulation = mode()
    if emulation is None:
        raise ConfigError(f"a process group on the {BACKEND} backend needs {ENV}=pair or =group")
    return EmulatedNCCLGroup(store, rank, size, timeout, emulation)


_live: "weakref.WeakSet[EmulatedNCCLGroup]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for group in list(_live):
        group.shutdown()


_original_batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv


def _batch_isend_irecv(p2p_op_list: list) -> list:
    """torch's ``batch_isend_irecv``; on an emulated group, its ops form one NCCL group (one batch)."""
    group = p2p_op_list[0].group if p2p_op_list else None
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(group, EmulatedNCCLGroup):
        with group.batch():
            return _original_batch_isend_irecv(p2p_op_list)
    return _original_batch_isend_irecv(p2p_op_list)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = _batch_isend_irecv
