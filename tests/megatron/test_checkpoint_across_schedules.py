"""Moving a running job to another schedule through a Megatron distributed checkpoint (CPU, gloo).

A run trains two steps under one schedule, saves (Megatron's ``dist_checkpointing``, ``torch_dist``,
the distributed optimizer's fully reshardable form), and a fresh model and optimizer built for another
schedule -- other placement (V <-> interleaved) and other vpp -- load it and train two more steps. The
losses of those steps and the final parameters are bitwise those of an uninterrupted four-step run.
Distributed optimizer with Adam, overlapped reduce and parameter gather, tied embeddings; pp 2 (x DP 2)
and pp 4.
"""

import dataclasses
import functools
import importlib.util
import os
import shutil

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
              pytest.mark.slow]  # two gloo launches of 4 ranks, ~15 s each

from megatron_harness import assert_same_tensors  # noqa: E402

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

MODEL = dataclasses.replace(tiny_models.TINY_MODELS["tiny-gpt"], tie_embeddings=True)
DDP = {"overlap_grad_reduce": True, "use_distributed_optimizer": True, "overlap_param_gather": True}
M, SAVED_AT, STEPS = 4, 2, 4
MOVES = (("zbv", "1f1b"), ("1f1b", "zbv"), ("v-half", "interleaved-1f1b"), ("interleaved-1f1b", "v-half"))


def _schedule(algorithm: str, pp: int):
    schedule = PrimusForwardBackward(PrimusPipeConfig(True, algorithm))
    table = schedule.table_for(pp, None, M)
    spec_for = lambda it: compare.StepSpec(MODEL, M, seed=it, ddp=True, placement=compare.placement_of(table),  # noqa: E731
                                           ddp_overrides=DDP, optimizer="adam", lr=0.01)
    return schedule, table.vpp, spec_for


def _steps(schedule, spec_for, wrapped, optimizer, iterations) -> list:
    losses = []
    for it in iterations:
        for m in wrapped:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        out, _ = compare.call_schedule(schedule, spec_for(it), wrapped)
        optimizer.step()
        losses.append([d["lm loss"].tolist() for d in out])
    return losses


def _final_params(chunks, wrapped) -> dict:
    for m in wrapped:
        m.start_param_sync(force_sync=True)  # the gather overlap_param_gather leaves to the next forward
    return {tiny_models.global_param_name(c, n): p.detach().clone() for c in chunks for n, p in c.named_parameters()}


def _worker(pp: int, directory: str, ctx) -> dict:
    import torch

    out = {"dp": ctx.dp_rank}
    for saver, loader in MOVES:
        schedule, vpp, spec_for = _schedule(saver, pp)
        _, chunks, wrapped = compare.build(spec_for(0), pp, vpp)
        optimizer = compare.make_optimizer(spec_for(0), wrapped)
        before = _steps(schedule, spec_for, wrapped, optimizer, range(SAVED_AT))
        path = os.path.join(directory, f"{saver}-to-{loader}")
        if torch.distributed.get_rank() == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        compare.save_checkpoint(path, wrapped, optimizer, SAVED_AT)
        uninterrupted = before + _steps(schedule, spec_for, wrapped, optimizer, range(SAVED_AT, STEPS))
        uninterrupted_params = _final_params(chunks, wrapped)

        schedule, vpp, spec_for = _schedule(loader, pp)
        _, chunks, wrapped = compare.build(dataclasses.replace(spec_for(0), seed=99), pp, vpp)  # other weights
        optimizer = compare.make_optimizer(spec_for(0), wrapped)
        iteration = compare.load_checkpoint(path, wrapped, optimizer)
        resumed = _steps(schedule, spec_for, wrapped, optimizer, range(iteration, STEPS))
        out[(saver, loader)] = {"uninterrupted": uninterrupted[SAVED_AT:], "resumed": resumed,
                                "iteration": iteration, "params": (uninterrupted_params, _final_params(chunks, wrapped))}
    return out


@functools.lru_cache(maxsize=None)
def _run(pp: int, directory: str) -> list:
    layout = ParallelLayout(2, dp=2) if pp == 2 else ParallelLayout(4)
    try:
        return run_on_gloo(functools.partial(_worker, pp, directory), layout, timeout_s=600)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.mark.parametrize("pp", (2, 4))
@pytest.mark.parametrize("saver,loader", MOVES, ids=[f"{a}-to-{b}" for a, b in MOVES])
def test_checkpoint_saved_under_one_schedule_continues_exactly_under_another(pp, saver, loader, checkpoints):
    results = _run(pp, os.path.join(checkpoints, f"pp{pp}"))
    with_losses = [r[(saver, loader)] for r in results if any(r[(saver, loader)]["resumed"])]
    assert with_losses, "some rank holds the loss"
    for run in with_losses:
        assert run["iteration"] == SAVED_AT
        assert run["resumed"] == run["uninterrupted"] and len(run["resumed"]) == STEPS - SAVED_AT
    uninterrupted = compare.merge_ranks({f"{k}@dp{r['dp']}": v for k, v in r[(saver, loader)]["params"][0].items()}
                                        for r in results)
    resumed = compare.merge_ranks({f"{k}@dp{r['dp']}": v for k, v in r[(saver, loader)]["params"][1].items()}
                                  for r in results)
    assert_same_tensors(resumed, uninterrupted, "final params", bitwise=True)
