"""The hang watchdog: it never makes the host wait where the backend orders waits on the device stream
(a monitor thread enforces the deadline and aborts the group), keeps gloo's deadline on the waiting
thread, and names the rank that stopped on every rank of a waiting cascade."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import PipelineHangError
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.runtime.protocols import Pending
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.runtime.transport import P2PTransport
from primuspipe.runtime.watchdog import TransferWatchdog
from emulation_limits import GROUP_NOT_FREED
from primuspipe.testing.gloo import WorkerError, run_gloo

H, BATCH = 4, 2


class _StreamOrderedWork:
    """An NCCL-like request: ``wait()`` returns at once (it orders a stream); ``is_completed()`` is the truth."""

    def __init__(self):
        self.done = False
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return True

    def is_completed(self):
        return self.done


class _Group:
    aborted = False

    def abort(self):
        self.aborted = True


def test_monitor_thread_enforces_deadlines_without_blocking_the_host():
    def work(rank, world):
        transport = P2PTransport(dist.group.WORLD, timeout_s=0.5)
        watchdog = transport.watchdog = TransferWatchdog(dist.group.WORLD, 0.5, poll_completion=True)
        watchdog.group = group = _Group()
        fast, stuck = _StreamOrderedWork(), _StreamOrderedWork()
        done = watchdog.track(Pending(ScheduleNode(NodeKind.SEND_F, 0, 0, peer=1), None, [fast]))
        pending = Pending(ScheduleNode(NodeKind.RECV_B, 1, 0, peer=1), None, [stuck])
        watchdog.track(pending)
        start = time.monotonic()
        transport.complete(pending)  # stream-ordered: returns although the transfer is not done
        returned_after = time.monotonic() - start
        fast.done = True
        time.sleep(1.5)
        try:
            transport.complete(pending)
            message = "no error"
        except PipelineHangError as exc:
            message = str(exc)
        return returned_after, stuck.waits, group.aborted, message, done > start - 1

    returned_after, waits, aborted, message, _ = run_gloo(work, 1, timeout_s=60)[0]
    assert returned_after < 0.1 and waits == 1, "complete() must not wait for the transfer on the host"
    assert aborted, "past the deadline the group is aborted, so device-side waits fail instead of hanging"
    assert "pipeline rank 0: RECV_B1.0<1 (receive from pipeline rank 1) did not complete within 0.5 s" in message


def test_gloo_wait_keeps_the_deadline_counted_from_posting():
    def work(rank, world):
        transport = P2PTransport(dist.group.WORLD, timeout_s=3.0)
        if rank == 1:  # takes part in opening the transport's channels (its first transfer), then never sends
            transport.irecv(ScheduleNode(NodeKind.RECV_B, 0, 0, peer=0), torch.empty(3))
            time.sleep(3.5)
            return None
        pending = transport.irecv(ScheduleNode(NodeKind.RECV_F, 0, 0, peer=1), torch.empty(3))
        time.sleep(2.0)  # the host does other work; the deadline still runs from posting
        start = time.monotonic()
        try:
            transport.complete(pending)
        except PipelineHangError as exc:
            return str(exc), time.monotonic() - start
        return "no error", 0.0

    message, waited = run_gloo(work, 2, timeout_s=60)[0]
    assert "RECV_F0.0<1" in message and "did not complete within 3 s" in message
    assert 0.5 < waited < 2.5, f"waited {waited:.2f} s after a 2 s head start: the deadline counts from posting"


@GROUP_NOT_FREED
def test_a_watchdog_does_not_keep_its_process_group_alive():
    """A destroyed group must be freed (with its gloo worker threads) although a watchdog watched it, and
    the watchdog's thread must end: a group kept alive into the interpreter's exit aborted torchrun ranks
    ("terminate called without an active exception", a gloo worker needing the GIL while Python finalizes)."""
    def work(rank, world):
        group = dist.new_group([0, 1])
        transport = P2PTransport(group, timeout_s=0.5)
        watchdog, freed = transport.watchdog, weakref.ref(group)
        dist.destroy_process_group(group)
        del group, transport
        gc.collect()
        watchdog._thread.join(timeout=5.0)
        return freed() is None, watchdog._thread.is_alive()

    for freed, thread_alive in run_gloo(work, 2, timeout_s=60):
        assert freed, "the watchdog kept a destroyed process group alive"
        assert not thread_alive, "the watchdog's thread outlived its process group"


def _wait_until_stopped(pid: int, timeout_s: float = 30.0) -> None:
    """Poll ``/proc`` until ``pid`` is in the stopped state (``T``), so resuming it cannot come first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not stop within {timeout_s:.0f} s")


def test_every_rank_of_a_cascade_names_the_stopped_rank():
    """pp=3: rank 2 stops (SIGSTOP) after joining; rank 1 waits on rank 2 and rank 0 on rank 1. Both
    errors name rank 2 (its heartbeat went silent; rank 1's did not). Rank 1 then resumes rank 2."""
    timeout = 3.0
    table = build_schedule("1f1b", pp=3, microbatches=2)

    def work(rank, world):
        store = dist.distributed_c10d._get_default_store()
        transport = P2PTransport(dist.group.WORLD, timeout_s=timeout)
        if rank == 2:
            store.set("stopped-pid", str(os.getpid()))
            time.sleep(0.3)
            # The harness's store is a file under a lock: stopped while its heartbeat thread held that lock,
            # rank 2 would block every store call of ranks 0 and 1. End the thread first, then stop.
            transport.watchdog.stop()
            os.kill(os.getpid(), signal.SIGSTOP)
            return "resumed"
        stage = torch.nn.Linear(H, H)
        binder = ModuleBinder([stage], num_stages=3, inputs=[torch.randn(BATCH, H) for _ in range(2)],
                              loss_fn=lambda out, mb: out.sum(), transfer_shape=(BATCH, H))
        try:
            ScheduleRunner(table, rank).run(binder, transport)
            message = "no error"
        except PipelineHangError as exc:
            message = str(exc)
        if rank == 1:  # one rank resumes rank 2, once it has stopped: a SIGCONT sent earlier is lost
            store.wait(["stopped-pid"], timedelta(seconds=30))
            stopped = int(store.get("stopped-pid"))
            _wait_until_stopped(stopped)
            os.kill(stopped, signal.SIGCONT)
        return message

    try:
        results = run_gloo(work, 3, timeout_s=60)
    except WorkerError as exc:
        raise AssertionError(str(exc)) from exc
    for rank in (0, 1):
        assert "did not complete within 3 s" in results[rank], results[rank]
        assert "Not responding (dead or stopped): pipeline rank 2 (silent for" in results[rank], results[rank]
        assert "pipeline rank 1 (" not in results[rank].split("Not responding")[1], "rank 1 is alive, only waiting"
    assert results[2] == "resumed"


@pytest.mark.gpu
def test_nccl_watchdog_never_blocks_the_host():
    """Two GPUs: a receive whose sender never sends. ``complete`` returns at once (stream-ordered); the
    monitor thread reports it within the timeout and the next transport call raises."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL refuses two ranks on one GPU)")
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Manager().dict()
    store_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pp-nccl-watchdog-{os.getpid()}")
    mp.spawn(_nccl_worker, args=(store_dir, results), nprocs=2, join=True)
    returned_after, message = results[0]
    assert returned_after < 0.05, f"complete() blocked the host for {returned_after:.3f} s"
    assert "RECV_F0.0<1" in message and "did not complete within 2 s" in message


def _nccl_worker(rank, store_dir, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_dir, 2), rank=rank, world_size=2)
    if rank == 1:
        time.sleep(6)
        return
    transport = P2PTransport(dist.group.WORLD, timeout_s=2.0)
    pending = transport.irecv(ScheduleNode(NodeKind.RECV_F, 0, 0, peer=1), torch.empty(4, device="cuda"))
    start = time.monotonic()
    transport.complete(pending)
    returned_after = time.monotonic() - start
    time.sleep(3.5)
    try:
        transport.irecv(ScheduleNode(NodeKind.RECV_F, 1, 0, peer=1), torch.empty(4, device="cuda"))
        message = "no error"
    except PipelineHangError as exc:
        message = str(exc)
    results[0] = (returned_after, message)
    os._exit(0)  # the aborted communicator cannot be destroyed cleanly


def test_a_forked_child_stopped_from_outside_does_not_end_its_parent(tmp_path):
    """A child forked after the SIGTERM reporter was installed (a DataLoader worker, a harness rank) shares
    the parent's wakeup socket unless the reporter lets go of it at fork: its SIGTERM then ended the
    parent with status 143 (the whole test suite, once a test had installed the reporter in-process)."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing, time
        from primuspipe.runtime.termination import TerminationReporter
        TerminationReporter.install(lambda signum: ["parent reported"])
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
        child.start()
        time.sleep(0.3)
        child.terminate()
        child.join()
        time.sleep(0.5)  # the parent's listener would have run by now
        print("parent alive, child exit", child.exitcode)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "parent alive, child exit -15" in done.stdout, (done.returncode, done.stderr)
