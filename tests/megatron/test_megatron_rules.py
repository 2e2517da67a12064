"""Megatron's own argument rules on the data-parallel side of pipeline scheduling, in real megatron-core
training (CPU, gloo, DP=2 x PP=2): what the Megatron backend refuses, and what it runs although Megatron-LM's
``validate_args`` refuses it (docs/megatron.md, "Megatron's own pipeline rules"; that table lists every rule).

* ``overlap_param_gather`` without the distributed optimizer: Megatron-LM refuses it; megatron-core's DDP takes
  the layer-wise optimizer's all-gather path, which fails in the forward hook of the first parameter sync. The
  backend refuses it in one line at its first call, on every rank, before any transfer.
* ``overlap_param_gather`` without ``overlap_grad_reduce``: Megatron-LM refuses it, megatron-core runs it; so
  does the backend, with Megatron's own schedule's parameters, gradients and losses bit for bit (zb-h1 against
  Megatron's 1F1B, zbv against its interleaved schedule at vpp 2).
"""

import dataclasses
import functools
import importlib.util

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
              pytest.mark.slow]  # one gloo launch of 4 ranks

from megatron_harness import assert_same_tensors  # noqa: E402

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.errors import ConfigError  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

PP, M, STEPS = 2, 4, 3
MODEL = dataclasses.replace(tiny_models.TINY_MODELS["tiny-gpt"], num_layers=4)
WITHOUT_DIST_OPT = {"overlap_grad_reduce": True, "use_distributed_optimizer": False, "overlap_param_gather": True}
WITHOUT_GRAD_OVERLAP = {"overlap_grad_reduce": False, "use_distributed_optimizer": True, "overlap_param_gather": True,
                        "bucket_size": 400}
RELAXED = {"zb-h1": 1, "zbv": 2}
"""Algorithm -> the vpp of Megatron's schedule it is compared with."""


def _spec_for(ddp: dict, optimizer: str, placement: str = "interleaved"):
    return lambda it: compare.StepSpec(MODEL, M, seed=it, ddp=True, placement=placement, ddp_overrides=ddp,
                                       optimizer=optimizer, lr=0.01)


def _worker(ctx) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = {"dp": ctx.dp_rank, "pp_rank": ctx.pp_rank, "runs": {}}
    ours = PrimusForwardBackward(PrimusPipeConfig(True, "zb-h1"))
    try:
        compare.train(ours, _spec_for(WITHOUT_DIST_OPT, "sgd"), PP, 1, 1)
    except ConfigError as exc:
        out["refused"] = str(exc)
    for vpp in sorted(set(RELAXED.values())):
        native = get_forward_backward_func(PP, vpp if vpp > 1 else None)
        out["runs"][f"native-vpp{vpp}"] = compare.train(native, _spec_for(WITHOUT_GRAD_OVERLAP, "adam"), PP, vpp, STEPS)
    for algorithm in RELAXED:
        ours = PrimusForwardBackward(PrimusPipeConfig(True, algorithm))
        table = ours.table_for(PP, None, M)
        spec_for = _spec_for(WITHOUT_GRAD_OVERLAP, "adam", compare.placement_of(table))
        out["runs"][algorithm] = compare.train(ours, spec_for, PP, table.vpp, STEPS)
    return out


@functools.lru_cache(maxsize=None)
def _run() -> list:
    return run_on_gloo(_worker, ParallelLayout(PP, dp=2), timeout_s=600)


def test_overlap_param_gather_without_the_distributed_optimizer_is_refused_on_every_rank():
    for r in _run():
        assert r.get("refused", "").startswith("Megatron's overlap_param_gather=True on model chunk 0 needs the "
                                               "distributed optimizer"), r.get("refused")
        assert "set use_distributed_optimizer=True" in r["refused"] and "\n" not in r["refused"]


def _merged(results, key: str, attr: str, step: int | None = None) -> dict:
    def of(r):
        value = getattr(r["runs"][key], attr)
        return value if step is None else value[step]

    return compare.merge_ranks({f"{name}@dp{r['dp']}": v for name, v in of(r).items()} for r in results)


@pytest.mark.parametrize("algorithm", RELAXED)
def test_overlap_param_gather_without_overlap_grad_reduce_runs_as_megatrons_schedule(algorithm):
    results = _run()
    native = f"native-vpp{RELAXED[algorithm]}"
    for r in results:
        ours, theirs = r["runs"][algorithm].losses, r["runs"][native].losses
        assert bool(all(ours)) == (r["pp_rank"] == PP - 1) and len(ours) == STEPS
        for got, want in zip(ours, theirs):
            assert [d["lm loss"].tolist() for d in got] == [d["lm loss"].tolist() for d in want]
    for step in range(STEPS):
        assert_same_tensors(_merged(results, algorithm, "grads", step), _merged(results, native, "grads", step),
                            f"grads of step {step}", bitwise=True)
    assert_same_tensors(_merged(results, algorithm, "params"), _merged(results, native, "params"), "params",
                        bitwise=True)
