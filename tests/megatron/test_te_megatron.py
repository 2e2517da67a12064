"""TE-deferred weight gradients in real megatron-core training on CPU (gloo), with the STAND-IN for
Transformer Engine's modules (primuspipe/testing/te_standin.py; TE needs CUDA).

A GPTModel whose attention and MLP linears are Megatron-TE-style wrappers (tests/support/te_vendor_layers.py)
built with ``delay_wgrad_compute`` -- the MoE model's experts megatron-core's TEGroupedMLP over stand-in
grouped linears -- wrapped in Megatron DDP with ``ddp_config.delay_wgrad_compute`` (so DDP hooks the
gradients through ``backward_dw``), is trained one step by primuspipe's zero-bubble tables (zb-h1, zb-h2;
the V tables zbv and dualpipe-v, two chunks per rank) and by its fused 1F1B, against Megatron's own 1F1B
(V tables: its pp=1 step) on the same model without deferral. Losses and weight gradients are bitwise
equal; bias gradients of skip_bias_add layers are summed in a different grouping (autograd adds two
microbatches' before the W's hook moves them to main_grad), so they are compared to 1e-6.
"""

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")]

from megatron_harness import assert_same_tensors, stacked_losses  # noqa: E402

from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

GPT = tiny_models.TINY_MODELS["tiny-gpt"]
MOE = tiny_models.TINY_MODELS["tiny-moe"]
M = 5
RUNS = {"megatron-1f1b": (GPT, None, False), "zb-h1": (GPT, "zb-h1", True), "zb-h2": (GPT, "zb-h2", True),
        "primuspipe-1f1b": (GPT, "1f1b", True),
        "moe-megatron-1f1b": (MOE, None, False), "moe-zb-h1": (MOE, "zb-h1", True)}
"""run -> (model; primuspipe algorithm, or None for Megatron's own schedule; TE deferral on). The MoE
model's experts are megatron-core's TEGroupedMLP over stand-in GroupedLinear layers."""


def _te_style_spec(original):
    """megatron-core's local GPT layer spec with every linear replaced by the TE-style stand-in, and MoE
    experts by megatron-core's TEGroupedMLP over stand-in grouped linears."""
    import functools

    import te_vendor_layers as vendor
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    def spec(*args, **kwargs):
        layer = original(*args, **kwargs)
        attention, mlp = layer.submodules.self_attention.submodules, layer.submodules.mlp.keywords["submodules"]
        for name in ("linear_qkv", "linear_proj"):
            setattr(attention, name, vendor.MegatronStyleLinear)
        if hasattr(mlp, "experts"):
            grouped = vendor.MegatronStyleGroupedLinear
            mlp.experts = functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(grouped, grouped))
        else:
            mlp.linear_fc1 = mlp.linear_fc2 = vendor.MegatronStyleLinear
        return layer

    return spec


def _step(model_config, algorithm, defer, pp=2, vpp=1, placement="interleaved"):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from primuspipe.backends.megatron.config import PrimusPipeConfig
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.backends.megatron.te_deferral import enable_delay_wgrad_compute

    config = tiny_models.transformer_config(model_config, pp, vpp)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    if defer:
        enable_delay_wgrad_compute(config, ddp_config)
    original = gpt_layer_specs.get_gpt_layer_local_spec
    gpt_layer_specs.get_gpt_layer_local_spec = _te_style_spec(original)
    try:
        chunks = tiny_models.build_model_chunks(model_config, config, placement=placement)
    finally:
        gpt_layer_specs.get_gpt_layer_local_spec = original
    model = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    for m in model:
        m.zero_grad_buffer()
    schedule = get_forward_backward_func() if algorithm is None else \
        PrimusForwardBackward(PrimusPipeConfig(True, algorithm))
    spec = compare.StepSpec(model_config, M, ddp=True, placement=placement)
    losses, _ = compare.call_schedule(schedule, spec, model)
    result = compare.StepResult([compare._detach(x) for x in losses], compare.param_grads(chunks, ddp=True), {}, 0.0)
    deferring = sum(getattr(m, "wgrad_store", None) is not None and m.need_backward_dw()
                    for c in chunks for m in c.modules())
    return result, deferring


@pytest.fixture(scope="module")
def results():
    def work(ctx):
        return {run: _step(*how) for run, how in RUNS.items()}

    return run_on_gloo(work, ParallelLayout(2), timeout_s=300)


@pytest.mark.parametrize("run", [r for r, (_, algorithm, _) in RUNS.items() if algorithm is not None])
def test_te_deferred_run_matches_megatron(results, run):
    moe = run.startswith("moe-")
    for rank, result in enumerate(results):
        (got, deferring), (want, plain) = result[run], result["moe-megatron-1f1b" if moe else "megatron-1f1b"]
        assert deferring == 4 * GPT.num_layers // 2 and plain == 0, f"rank {rank}: the stand-in layers did not defer"
        if want.losses:
            assert torch.equal(stacked_losses(got), stacked_losses(want))
        biases = {n for n in want.grads if n.endswith(".bias")}
        assert_same_tensors({n: g for n, g in got.grads.items() if n not in biases},
                            {n: g for n, g in want.grads.items() if n not in biases}, f"rank {rank} grad",
                            bitwise=True)
        assert_same_tensors({n: got.grads[n] for n in biases}, {n: want.grads[n] for n in biases},
                            f"rank {rank} bias grad")


@pytest.fixture(scope="module")
def v_results():
    """V-shape tables (two chunks per rank, one FIFO per chunk's module) and Megatron's pp=1 step."""
    def v_work(ctx):
        return {algorithm: _step(GPT, algorithm, True, 2, 2, "v") for algorithm in ("zbv", "dualpipe-v")}

    def reference(ctx):
        return _step(GPT, None, False, 1, 1)

    return run_on_gloo(v_work, ParallelLayout(2, vpp=2), timeout_s=300), run_on_gloo(reference, ParallelLayout(1))[0]


@pytest.mark.parametrize("algorithm", ["zbv", "dualpipe-v"])
def test_te_deferred_v_tables_match_megatron_pp1(v_results, algorithm):
    results, (want, plain) = v_results
    assert plain == 0 and all(r[algorithm][1] == 4 * GPT.num_layers // 2 for r in results)
    assert torch.equal(stacked_losses(results[-1][algorithm][0]), stacked_losses(want))
    got = compare.merge_ranks(r[algorithm][0].grads for r in results)
    biases = {n for n in want.grads if n.endswith(".bias")}
    assert_same_tensors({n: g for n, g in got.items() if n not in biases},
                        {n: g for n, g in want.grads.items() if n not in biases}, "grad", bitwise=True)
    assert_same_tensors({n: got[n] for n in biases}, {n: want.grads[n] for n in biases}, "bias grad")
