"""Expert tensor parallelism and multi-token prediction (MTP) under V and interleaved tables, in real
megatron-core training (CPU, gloo, PP=2 x DP=2): one DDP step with Megatron's SGD per case, bitwise
equal to Megatron's own schedule at the same pp and vpp (losses on the last pipeline rank, every gradient
and every parameter after the step). What cannot be run is refused in one line: MTP in a V table, MTP
with tied embeddings and gradient-accumulation fusion under a B/W table, context parallelism.
"""

import dataclasses
import functools
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
              pytest.mark.slow]  # one gloo launch of 4 ranks, ~15 s

from megatron_harness import assert_same_tensors  # noqa: E402

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.errors import ConfigError  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

PP, M = 2, 4
MOE = tiny_models.TINY_MODELS["tiny-moe"]
GPT = tiny_models.TINY_MODELS["tiny-gpt"]
CASES = {  # name -> (model, overrides, algorithms)
    "expert-tp2": (MOE, {"moe_token_dispatcher_type": "alltoall"}, ("zb-h1", "interleaved-1f1b", "zbv", "v-half")),
    "mtp": (GPT, {"mtp_num_layers": 1, "gradient_accumulation_fusion": True}, ("zb-h1", "zb-h2", "interleaved-1f1b")),
}
REFUSED = {  # name -> (model, overrides, algorithm, what the one line says)
    "mtp-in-v": (GPT, {"mtp_num_layers": 1}, "zbv", "places stages in a V, but mtp_num_layers=1"),
    "mtp-tied-fusion-bw": (dataclasses.replace(GPT, tie_embeddings=True),
                           {"mtp_num_layers": 1, "gradient_accumulation_fusion": True}, "zb-h1",
                           "mtp_num_layers=1 with tied embeddings and gradient_accumulation_fusion"),
}


def _spec(model, overrides, placement):
    return compare.StepSpec(model, M, ddp=True, optimizer_step=True, config_overrides=overrides, placement=placement)


def _result(step: compare.StepResult) -> dict:
    return {"losses": step.losses, "grads": step.grads, "params": step.params}


def _worker(ctx) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = {"dp": ctx.dp_rank, "pp_rank": ctx.pp_rank}
    for name, (model, overrides, algorithms) in CASES.items():
        for vpp in (1, 2):
            native = get_forward_backward_func(PP, vpp if vpp > 1 else None)
            out[(name, f"native-vpp{vpp}")] = _result(compare.run_step(native, _spec(model, overrides, "interleaved"),
                                                                       PP, vpp))
        for algorithm in algorithms:
            ours = PrimusForwardBackward(PrimusPipeConfig(True, algorithm))
            table = ours.table_for(PP, None, M)
            step = compare.run_step(ours, _spec(model, overrides, compare.placement_of(table)), PP, table.vpp)
            out[(name, algorithm)] = dict(_result(step), vpp=table.vpp)
    for name, (model, overrides, algorithm, _) in REFUSED.items():
        ours = PrimusForwardBackward(PrimusPipeConfig(True, algorithm))
        table = ours.table_for(PP, None, M)
        try:
            compare.run_step(ours, _spec(model, overrides, compare.placement_of(table)), PP, table.vpp)
        except ConfigError as exc:
            out[("refused", name)] = str(exc)
    return out


@functools.lru_cache(maxsize=None)
def _run() -> list:
    return run_on_gloo(_worker, ParallelLayout(PP, dp=2, etp=2), timeout_s=600)


def _merged(results, key, attr) -> dict:
    """``attr`` of run ``key`` over all ranks by global name and data-parallel rank; with MTP by pipeline
    rank too (the last stage holds its own copy of the word embedding; MTP runs only with Megatron's
    placement, so both sides place every layer alike)."""
    rank = (lambda r: f"pp{r['pp_rank']}") if key[0] == "mtp" else (lambda r: "")
    return compare.merge_ranks({f"{n}@{rank(r)}dp{r['dp']}": v for n, v in r[key][attr].items()} for r in results)


RUNS = [pytest.param(name, a, id=f"{name}-{a}") for name, (_, _, algorithms) in CASES.items() for a in algorithms]


@pytest.mark.parametrize("name,algorithm", RUNS)
def test_matches_megatron_bitwise(name, algorithm):
    results = _run()
    ours, native = (name, algorithm), (name, f"native-vpp{results[0][(name, algorithm)]['vpp']}")
    for r in results:
        if r["pp_rank"] == PP - 1:
            got, want = r[ours]["losses"], r[native]["losses"]
            assert len(got) == len(want) == M
            assert all(torch.equal(g["lm loss"], w["lm loss"]) for g, w in zip(got, want))
        else:
            assert not r[ours]["losses"]
    if name == "expert-tp2":  # the experts really are split over the two expert tensor-parallel ranks
        params = _merged(results, ours, "params")
        fc1 = [k for k in params if ".experts.local_experts." in k and k.split("@")[0].endswith("linear_fc1.weight")]
        assert fc1 and all(params[k].shape[0] == MOE.ffn_hidden_size // 2 for k in fc1)
    for attr in ("grads", "params"):
        assert_same_tensors(_merged(results, ours, attr), _merged(results, native, attr), attr, bitwise=True)


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_in_one_line(name):
    messages = {r.get(("refused", name)) for r in _run()}
    (message,) = messages
    assert message is not None and REFUSED[name][3] in message and "\n" not in message


def test_context_parallelism_is_refused_in_one_line():
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.backends.megatron.compat import check_megatron_config
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    config = tiny_models.transformer_config(GPT, 2, 1)
    config.context_parallel_size = 2
    with pytest.raises(ConfigError, match="context_parallel_size=2 is not supported") as refused:
        check_megatron_config(config, build_schedule("1f1b", pp=2, microbatches=2), [torch.nn.Linear(1, 1)])
    assert "\n" not in str(refused.value)
