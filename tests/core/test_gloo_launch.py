"""The local gloo launcher: results by rank, a failing rank reported with its traceback, no hang."""

import time

import pytest
import torch
import torch.distributed as dist

from primuspipe.errors import ConfigError, PipelineHangError
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
