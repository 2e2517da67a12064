"""The local gloo launcher: results by rank, a failing rank reported with its traceback, no hang."""

import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from primuspipe.errors import ConfigError, PipelineHangError
from primuspipe.testing import gloo
from primuspipe.testing.gloo import WorkerError, run_gloo


def test_ranks_share_a_gloo_group_and_return_results_by_rank():
    def work(rank, world):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return rank, world, t.item(), torch.get_num_threads()

    assert run_gloo(work, 3, timeout_s=60) == [(0, 3, 6.0, 1), (1, 3, 6.0, 1), (2, 3, 6.0, 1)]


def test_a_failing_rank_is_reported_with_its_traceback():
    def work(rank, world):
        if rank == 1:
            raise ValueError("boom on rank 1")
        return rank

    with pytest.raises(WorkerError, match="boom on rank 1") as err:
        run_gloo(work, 2, timeout_s=60)
    assert err.value.rank == 1 and "ValueError" in err.value.traceback


def test_a_stuck_rank_raises_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(PipelineHangError, match=r"ranks \[1\] did not finish within 2 s"):
        run_gloo(lambda rank, world: time.sleep(30 if rank == 1 else 0), 2, timeout_s=2)
    assert time.monotonic() - start < 10


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="timeout_s"):
        run_gloo(lambda r, w: None, 2, timeout_s=0)
    with pytest.raises(ConfigError, match="world_size"):
        run_gloo(lambda r, w: None, 0)


def _heap_misuse():
    """free() of a pointer malloc never gave out: glibc prints "free(): invalid pointer" and aborts, as it
    does on the heap corruption a use-after-free leaves (a native crash, no Python exception)."""
    import ctypes

    buffer = ctypes.create_string_buffer(64)
    ctypes.CDLL(None).free(ctypes.c_void_p(ctypes.addressof(buffer) + 33))


def test_a_rank_that_dies_natively_is_named_with_its_signal_and_its_stderr():
    def work(rank, world):
        if rank == 1:
            print("rank 1 about to misuse the heap", file=sys.stderr)
            _heap_misuse()
        return rank

    with pytest.raises(WorkerError) as err:
        run_gloo(work, 2, timeout_s=60)
    message = str(err.value)
    assert err.value.rank == 1, message
    assert "killed by SIGABRT" in message and "free(): invalid pointer" in message, message
    assert "rank 1 about to misuse the heap" in message and "Fatal Python error: Aborted" in message, message
    assert "in _heap_misuse" in message, message  # the fault handler's stack of the rank, innermost frames


def test_a_rank_failing_because_its_peer_died_does_not_take_the_blame():
    """A peer's death fails the others' transfers at once, and their errors often reach the launcher
    before the death does: the dead rank is still the one named."""
    def work(rank, world):
        if rank == 1:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("Connection closed by peer")  # what gloo raises on rank 0 once rank 1 is gone

    with pytest.raises(WorkerError) as err:
        run_gloo(work, 2, timeout_s=60)
    assert err.value.rank == 1 and "killed by SIGKILL" in str(err.value), str(err.value)
    assert "rank 0 failed after it: RuntimeError: Connection closed by peer" in str(err.value), str(err.value)


def test_every_ranks_stderr_reaches_the_callers_marked_with_its_rank(capfd):
    def work(rank, world):
        print(f"note from {rank}", file=sys.stderr)
        return rank

    assert run_gloo(work, 2, timeout_s=60) == [0, 1]
    err = capfd.readouterr().err
    assert "[gloo rank 0] note from 0" in err and "[gloo rank 1] note from 1" in err, err


def test_a_fault_handler_stack_dump_is_cut_to_the_innermost_frames():
    dump = ("boom\nFatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n"
            + "".join(f'  File "f.py", line {i} in inner{i}\n' for i in range(10))
            + "\nCurrent thread 0x00008f (most recent call first):\n  File \"g.py\", line 1 in g\n\n"
            + "Extension modules: numpy, torch (total: 2)\n")
    tail = gloo._stderr_tail(dump)
    assert "inner0" in tail and "inner3" in tail and "inner4" not in tail and "  ..." in tail, tail
    assert "Current thread" in tail and "in g" in tail and "boom" in tail and "Extension modules" not in tail, tail
