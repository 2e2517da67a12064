"""Every schedule family with the features Megatron users turn on, in real megatron-core training (CPU,
gloo): per feature and algorithm, one DDP step with Megatron's SGD optimizer (or one call of
``megatron.training``'s ``train_step``), compared with Megatron's own schedule at the same pipeline size
and vpp -- bitwise: the loss dicts on the last pipeline rank (``[]``/``{}`` elsewhere), every gradient
and every parameter after the step, per tensor-parallel shard.

Algorithms whose chunks Megatron cannot run (the V placement) are compared with Megatron's interleaved
schedule at vpp 2 on interleaved-built chunks with the same global weights; each algorithm's chunks are
built for the placement and vpp its table comes back with (zb-auto may choose). One gloo launch per
(pp, tensor-parallel) layout runs all of its features and algorithms; a table equal to one already stepped
(zb-auto's choice: v-half's table at pp 2, zbv's at pp 4) is compared through that step, as the runner runs a
table and never its algorithm's name.
"""

import dataclasses
import functools
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
              pytest.mark.slow]  # four gloo launches of 15-30 s each

from megatron_harness import assert_same_tensors  # noqa: E402

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402
from primuspipe.testing.megatron.train_step import run_train_step  # noqa: E402

ALGORITHMS = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "v-half", "dualpipe-v", "zb-auto")
GPT = tiny_models.TINY_MODELS["tiny-gpt"]
MOE = tiny_models.TINY_MODELS["tiny-moe"]


@dataclasses.dataclass(frozen=True)
class Feature:
    model: tiny_models.TinyModelConfig = GPT
    overrides: tuple = ()
    tensor_parallel: bool = False
    """Runs in the tp=2 (ep=2) layout."""
    train_step: bool = False
    """One call of megatron.training's train_step instead of forward-backward + optimizer step."""


FEATURES = {
    "tp2-sp": Feature(overrides=(("sequence_parallel", True), ("gradient_accumulation_fusion", True)),
                      tensor_parallel=True),
    "moe-ep2": Feature(MOE, (("sequence_parallel", True), ("moe_token_dispatcher_type", "alltoall"),
                             ("moe_shared_expert_intermediate_size", 32), ("moe_router_load_balancing_type", "aux_loss"),
                             ("moe_aux_loss_coeff", 0.01)), tensor_parallel=True),
    "recompute-full": Feature(overrides=(("recompute_granularity", "full"), ("recompute_method", "uniform"),
                                         ("recompute_num_layers", 1))),
    "recompute-selective": Feature(dataclasses.replace(GPT, add_bias_linear=False),
                                   (("recompute_granularity", "selective"),
                                    ("recompute_modules", ("core_attn", "layernorm", "mlp")))),
    "tied-embeddings": Feature(dataclasses.replace(GPT, tie_embeddings=True)),
    "per-token-loss": Feature(overrides=(("calculate_per_token_loss", True),)),
    "train-step": Feature(train_step=True),
}


def _layout(pp: int, tensor_parallel: bool) -> ParallelLayout:
    return ParallelLayout(pp, tp=2, ep=2) if tensor_parallel else ParallelLayout(pp)


def _spec(feature: Feature, m: int, placement: str) -> compare.StepSpec:
    overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in feature.overrides}
    return compare.StepSpec(feature.model, m, ddp=True, optimizer_step=not feature.train_step,
                            config_overrides=overrides, placement=placement)


def _step(feature: Feature, schedule, spec: compare.StepSpec, pp: int, vpp: int) -> dict:
    """losses, grads and params of one step, as plain picklable values."""
    if feature.train_step:
        result = run_train_step(schedule, spec, pp, vpp)
        return {"losses": result.loss_dict, "grads": result.grads, "params": result.params}
    result = compare.run_step(schedule, spec, pp, vpp)
    return {"losses": result.losses, "grads": result.grads, "params": result.params}


def _worker(pp: int, tensor_parallel: bool, ctx) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    m = 2 * pp
    out = {"replica": (ctx.tp_rank, ctx.dp_rank), "pp_rank": ctx.pp_rank}
    for name, feature in FEATURES.items():
        if feature.tensor_parallel != tensor_parallel:
            continue
        for vpp in (1, 2):
            native = get_forward_backward_func(pp, vpp if vpp > 1 else None)
            out[(name, f"native-vpp{vpp}")] = _step(feature, native, _spec(feature, m, "interleaved"), pp, vpp)
        stepped = {}  # a table's value (placement, microbatches, rows) -> its step's result
        for algorithm in ALGORITHMS:
            ours = PrimusForwardBackward(PrimusPipeConfig(True, algorithm))
            table = ours.table_for(pp, None, m)
            schedule = (table.placement, table.microbatches, table.ranks)
            if schedule not in stepped:  # zb-auto chooses another algorithm's table: the runner runs the same
                stepped[schedule] = dict(_step(feature, ours, _spec(feature, m, compare.placement_of(table)), pp,
                                               table.vpp), vpp=table.vpp)
            out[(name, algorithm)] = stepped[schedule]
    return out


@functools.lru_cache(maxsize=None)
def _run(pp: int, tensor_parallel: bool) -> list:
    return run_on_gloo(functools.partial(_worker, pp, tensor_parallel), _layout(pp, tensor_parallel), timeout_s=600)


def _merged(results: list, key: tuple, attr: str) -> dict:
    """``attr`` of run ``key`` over all ranks, named per tensor-parallel shard / data-parallel replica."""
    return compare.merge_ranks({f"{name}@tp{r['replica'][0]}dp{r['replica'][1]}": value
                                for name, value in r[key][attr].items()} for r in results)


def _assert_same_losses(got, want) -> None:
    if isinstance(want, dict):  # train_step's reduced loss dict
        assert got.keys() == want.keys() and want
        assert all(torch.equal(got[k], want[k]) for k in want), (got, want)
        return
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), (g, w)


PARAMS = [pytest.param(pp, feature, algorithm, id=f"pp{pp}-{feature}-{algorithm}")
          for pp in (2, 4) for feature in FEATURES for algorithm in ALGORITHMS]


@pytest.mark.parametrize("pp,feature,algorithm", PARAMS)
def test_schedule_with_feature_matches_megatron_bitwise(pp, feature, algorithm):
    results = _run(pp, FEATURES[feature].tensor_parallel)
    ours = (feature, algorithm)
    native = (feature, f"native-vpp{results[0][ours]['vpp']}")
    for r in results:  # Megatron's contract: loss dicts on the last pipeline stage, nothing elsewhere
        if r["pp_rank"] == pp - 1:
            _assert_same_losses(r[ours]["losses"], r[native]["losses"])
        else:
            assert not r[ours]["losses"] and not r[native]["losses"], "losses belong to the last pipeline stage"
    for attr in ("grads", "params"):
        assert_same_tensors(_merged(results, ours, attr), _merged(results, native, attr), attr, bitwise=True)
