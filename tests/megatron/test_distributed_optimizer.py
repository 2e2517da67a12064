"""Megatron's distributed optimizer with overlapped gradient reduce and overlapped parameter gather
under every schedule family, in real megatron-core training (CPU, gloo, DP=2 x PP=2).

Each run trains three steps with Adam (``use_distributed_optimizer``, ``overlap_grad_reduce``,
``overlap_param_gather``, buckets small enough that a chunk has several) and is compared bitwise with
Megatron's own schedule at the same pp and vpp: every loss of every step on the last pipeline rank, every
reduced gradient shard of every step, every parameter after the last step. Under
``align_grad_reduce`` (Megatron-LM's default, the schedule gets ``grad_sync_func``) and without it (DDP's
hooks would start the reduce). For B/W tables the order is checked too: each bucket's reduce starts after
the last ``W`` of its chunk on that rank, never before, and once per step. An algorithm whose table equals
one already trained (v-min's is v-half's at pp 2 and 4 microbatches) is checked through that run: the runner
runs a table, never its algorithm's name.
"""

import dataclasses
import functools
import os
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
              pytest.mark.slow]  # one gloo launch of 4 ranks, ~20 s

from megatron_harness import assert_same_tensors  # noqa: E402

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402
from primuspipe.runtime import nccl_emulation  # noqa: E402

PP, M, STEPS = 2, 4, 3
MODEL = dataclasses.replace(tiny_models.TINY_MODELS["tiny-gpt"], num_layers=4, tie_embeddings=True)
DDP = {"overlap_grad_reduce": True, "use_distributed_optimizer": True, "overlap_param_gather": True,
       "bucket_size": 400}
ALGORITHMS = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv", "v-half", "v-min", "dualpipe-v")
UNALIGNED = ("zb-h1", "zbv")
"""Also run without ``grad_sync_func`` (``align_grad_reduce=False``)."""


def _spec_for(placement: str, aligned: bool):
    return lambda it: compare.StepSpec(MODEL, M, seed=it, ddp=True, placement=placement, ddp_overrides=DDP,
                                       optimizer="adam", lr=0.01, align_grad_reduce=aligned)


class _Order:
    """Records, per step, the W nodes run and each bucket group's reduce start, in order."""

    def __init__(self, monkeypatch_targets):
        self.events: list[tuple] = []
        store, group = monkeypatch_targets
        flush, start = store.flush, group.start_grad_sync
        order = self

        def recorded_flush(self, chunk, microbatch):
            order.events.append(("W", chunk, microbatch))
            return flush(self, chunk, microbatch)

        def recorded_start(self, *args, **kwargs):
            if self.grad_reduce_handle is None:
                order.events.append(("reduce", id(self)))
            return start(self, *args, **kwargs)

        self.restore = lambda: (setattr(store, "flush", flush), setattr(group, "start_grad_sync", start))
        store.flush, group.start_grad_sync = recorded_flush, recorded_start


def _chunk_of_group(wrapped) -> dict:
    return {id(g): chunk for chunk, m in enumerate(wrapped) for g in m.bucket_groups + m.expert_parallel_bucket_groups}


def _worker(ctx) -> dict:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from primuspipe.backends.megatron.wgrad_store import WeightGradStore

    out = {"dp": ctx.dp_rank, "pp_rank": ctx.pp_rank, "runs": {}, "order": {}}
    for vpp in (1, 2):
        native = get_forward_backward_func(PP, vpp if vpp > 1 else None)
        out["runs"][f"native-vpp{vpp}"] = compare.train(native, _spec_for("interleaved", True), PP, vpp, STEPS)
    trained = {}  # (a table's value: placement, microbatches, rows; aligned) -> the run's key
    for algorithm in ALGORITHMS:
        for aligned in (True, False) if algorithm in UNALIGNED else (True,):
            ours = PrimusForwardBackward(PrimusPipeConfig(True, algorithm))
            table = ours.table_for(PP, None, M)
            key = f"{algorithm}{'' if aligned else '-unaligned'}"
            if (same := trained.setdefault((table.placement, table.microbatches, table.ranks, aligned), key)) != key:
                out["runs"][key], out["order"][key] = out["runs"][same], out["order"][same]  # v-min is v-half here
                continue
            spec_for = _spec_for(compare.placement_of(table), aligned)
            built = compare.build(spec_for(0), PP, table.vpp)
            order = _Order((WeightGradStore, _ParamAndGradBucketGroup))

            def step(**kwargs):
                order.events.append(("step",))
                return ours(**kwargs)

            try:
                result = compare.train(step, spec_for, PP, table.vpp, STEPS, model=built)
            finally:
                order.restore()
            groups = _chunk_of_group(built[2])
            out["runs"][key] = dataclasses.replace(result, step_times=[table.vpp])
            out["order"][key] = [(e[0], groups[e[1]]) if e[0] == "reduce" else e for e in order.events]
    return out


@functools.lru_cache(maxsize=None)
def _run(emulation: str | None = None) -> list:
    """Every rank's results; under ``PRIMUSPIPE_NCCL_EMULATION=emulation`` when given (NCCL's progress
    rules for every group Megatron makes on the default backend, the DP reduce-scatters included)."""
    saved = os.environ.pop(nccl_emulation.ENV, None)
    if emulation is not None:
        os.environ[nccl_emulation.ENV] = emulation
    try:
        return run_on_gloo(_worker, ParallelLayout(PP, dp=2), timeout_s=600)
    finally:
        os.environ.pop(nccl_emulation.ENV, None)
        if saved is not None:
            os.environ[nccl_emulation.ENV] = saved


def _merged(results, key: str, attr: str, step: int | None = None) -> dict:
    def of(r):
        value = getattr(r["runs"][key], attr)
        return value if step is None else value[step]

    return compare.merge_ranks({f"{name}@dp{r['dp']}": v for name, v in of(r).items()} for r in results)


RUNS = [pytest.param(a, aligned, id=f"{a}{'' if aligned else '-unaligned'}")
        for a in ALGORITHMS for aligned in ((True, False) if a in UNALIGNED else (True,))]


@pytest.mark.slow
@pytest.mark.parametrize("emulation", nccl_emulation.MODES)
def test_under_the_nccl_emulator_every_run_is_bitwise_the_gloo_run(emulation):
    """Overlapped reduce-scatters and param all-gathers on NCCL's streams: nothing hangs, nothing changes."""
    for gloo, emulated in zip(_run(None), _run(emulation)):
        for key, want in gloo["runs"].items():
            got = emulated["runs"][key]
            for attr in ("losses", "grads", "params"):
                assert _bitwise(getattr(got, attr), getattr(want, attr)), f"{key}: {attr} under {emulation}"


def _bitwise(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_bitwise(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("algorithm,aligned", RUNS)
def test_distributed_optimizer_overlapped_matches_megatron_bitwise(algorithm, aligned):
    results = _run()
    key = f"{algorithm}{'' if aligned else '-unaligned'}"
    native = f"native-vpp{results[0]['runs'][key].step_times[0]}"
    for r in results:
        ours, theirs = r["runs"][key].losses, r["runs"][native].losses
        if r["pp_rank"] == PP - 1:
            assert all(ours) and len(ours) == STEPS
            for got, want in zip(ours, theirs):
                assert [d["lm loss"].tolist() for d in got] == [d["lm loss"].tolist() for d in want]
        else:
            assert not any(ours) and not any(theirs)
    for step in range(STEPS):
        assert_same_tensors(_merged(results, key, "grads", step), _merged(results, native, "grads", step),
                            f"grads of step {step}", bitwise=True)
    assert_same_tensors(_merged(results, key, "params"), _merged(results, native, "params"), "params", bitwise=True)


SPLIT = [pytest.param(a, aligned, id=f"{a}{'' if aligned else '-unaligned'}")
         for a, aligned in (("zb-h1", True), ("zb-h1", False), ("zb-h2", True), ("zbv", True), ("zbv", False),
                            ("v-half", True), ("dualpipe-v", True))]


@pytest.mark.parametrize("algorithm,aligned", SPLIT)
def test_bucket_reduce_starts_after_the_chunks_last_w(algorithm, aligned):
    """Per step and chunk: every bucket group's reduce starts once, after the chunk's last W on the rank
    and before the step's end -- overlapped with whatever the rank runs after that W."""
    key = f"{algorithm}{'' if aligned else '-unaligned'}"
    for r in _run():
        events = r["order"][key]
        steps = []
        for event in events:
            if event[0] == "step":
                steps.append([])
            else:
                steps[-1].append(event)
        assert len(steps) == STEPS, (r["pp_rank"], events)
        for step in steps:
            last_w = {e[1]: i for i, e in enumerate(step) if e[0] == "W"}
            reduces = [(i, e[1]) for i, e in enumerate(step) if e[0] == "reduce"]
            assert {chunk for _, chunk in reduces} == set(last_w), step
            for i, chunk in reduces:
                assert i == last_w[chunk] + 1 or step[i - 1][0] == "reduce", (chunk, step)
            overlapped = [chunk for i, chunk in reduces if i < len(step) - 1 and any(e[0] == "W" for e in step[i:])]
            if len(last_w) > 1:  # a chunk that finishes first is reduced while the other still runs its Ws
                assert overlapped, step
