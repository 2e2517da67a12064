"""CPU mode's parameter all-gather on gloo (primuspipe.backends.megatron.gloo_all_gather), on real gloo ranks.

torch 2.13's fused all-gather on gloo corrupts the heap (with torch's manager in place of the shim, 4 of 4
launches of the stress pattern below lost a rank to SIGSEGV / SIGABRT); Megatron's parameter gather issues exactly that, so a Megatron
step on CPU could lose a rank at random. These tests run the shimmed manager the way
Megatron's ``start_param_sync`` / ``start_grad_sync`` do (each rank's shard a view into the bucket it gathers
into) and check the bytes, the handle and that the pattern survives.
"""

import functools
import importlib.util

import pytest
import torch

from primuspipe.testing.gloo import run_gloo

WORLD = 4


def _groups(size: int):
    import torch.distributed as dist

    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, WORLD, size)]
    return groups[dist.get_rank() // size]


def _blocks(group_size: int, rank: int, world: int) -> list:
    """Gather and reduce-scatter blocks through the shim, sync and async, on groups of ``group_size``."""
    import torch.distributed as dist

    from primuspipe.backends.megatron.gloo_all_gather import coalescing_manager

    group, me = _groups(group_size), rank % group_size
    results = []
    for async_ops in (False, True):
        buckets = [torch.zeros(group_size * n) for n in (3, 5)]
        for bucket in buckets:
            bucket.view(group_size, -1)[me].fill_(rank + 1)
        with coalescing_manager(group, async_ops=async_ops) as gathers:
            for bucket in buckets:
                dist.all_gather_into_tensor(bucket, bucket.view(group_size, -1)[me], group=group, async_op=async_ops)
        grads = [torch.full((group_size * 4,), float(rank + 1)) for _ in range(2)]
        with coalescing_manager(group, async_ops=async_ops) as reductions:
            for grad in grads:
                dist.reduce_scatter_tensor(grad.view(group_size, -1)[me], grad, group=group, async_op=async_ops)
        if async_ops:
            gathers.wait()
            reductions.wait()
        results.append((buckets, [g.view(group_size, -1)[me].clone() for g in grads]))
    return results


@pytest.mark.parametrize("group_size", (1, 2, 4))
def test_gathers_and_reductions_through_the_shim_give_torchs_bytes(group_size):
    for rank, runs in enumerate(run_gloo(functools.partial(_blocks, group_size), WORLD, timeout_s=120)):
        first = rank - rank % group_size
        members = [r + 1.0 for r in range(first, first + group_size)]
        for buckets, shards in runs:
            for bucket in buckets:
                n = bucket.numel() // group_size
                assert torch.equal(bucket, torch.tensor(members).repeat_interleave(n)), (rank, bucket)
            for shard in shards:
                assert torch.equal(shard, torch.full((4,), sum(members))), (rank, shard)


def _stress(rank: int, world: int) -> bool:
    """The pattern that broke torch's fused path: many async gathers in flight on a one-rank group."""
    import torch.distributed as dist

    from primuspipe.backends.megatron.gloo_all_gather import coalescing_manager

    group = _groups(1)
    buckets = [torch.randn(2560) for _ in range(2)]
    for _ in range(20_000):
        handles = []
        for bucket in buckets:
            with coalescing_manager(group, async_ops=True) as gathers:
                dist.all_gather_into_tensor(bucket, bucket.view(1, -1)[0], group=group, async_op=True)
            handles.append(gathers)
        for handle in handles:
            handle.wait()
    return True


@pytest.mark.slow
def test_many_async_gathers_on_a_one_rank_group_do_not_crash_a_rank():
    for _ in range(2):  # with torch's manager 4 of 4 such launches lost a rank to SIGSEGV / SIGABRT
        assert run_gloo(_stress, WORLD, timeout_s=300) == [True] * WORLD


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_cpu_mode_gives_megatrons_buffers_the_shim():
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
    from primuspipe.backends.megatron.gloo_all_gather import coalescing_manager

    enable_cpu_mode()
    from megatron.core.distributed import param_and_grad_buffer

    assert param_and_grad_buffer._coalescing_manager is coalescing_manager
