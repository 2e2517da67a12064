"""V-shape tables as a drop-in: the chunks come from an unchanged Megatron ``model_provider`` (through
``megatron.training``'s ``get_model`` once ``install()`` ran, or ``v_model_provider``), and each V
chunk holds exactly the layers Megatron assigns its stage -- the V of ``p`` ranks folds a ``2p``-stage
pipeline, so stage ``s`` gets what Megatron's own layer split gives pipeline stage ``s`` of ``2p``
(uneven first/last stage, ``account_for_embedding/loss_in_pipeline_split``). Splits the V cannot hold
are refused in one line. ``v-min`` at pp=4 with 10 layers and first/last stage 2 trains equal to the
pp=1 reference.
"""

import dataclasses
import functools
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from megatron_harness import assert_same_tensors  # noqa: E402

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.errors import ConfigError  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

GPT = tiny_models.TINY_MODELS["tiny-gpt"]
SPLITS = {  # (pp, num_layers, overrides)
    "even": (2, 8, {}),
    "loss": (2, 7, {"account_for_loss_in_pipeline_split": True}),
    "embedding": (2, 7, {"account_for_embedding_in_pipeline_split": True}),
    "embedding+loss": (2, 6, {"account_for_embedding_in_pipeline_split": True,
                              "account_for_loss_in_pipeline_split": True}),
    "first+last": (2, 6, {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}),
    "first": (2, 5, {"num_layers_in_first_pipeline_stage": 2}),
    "last": (2, 9, {"num_layers_in_last_pipeline_stage": 3}),
    "pp4-first+last": (4, 10, {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}),
    "pp4-loss": (4, 15, {"account_for_loss_in_pipeline_split": True}),
    "pp4-even": (4, 8, {}),
}
KNOWN = {  # written out by hand: the case, and the acceptance case
    "loss": [[0, 1], [2, 3], [4, 5], [6]],
    "pp4-first+last": [[0, 1], [2], [3], [4], [5], [6], [7], [8, 9]],
}


def _megatron_stage_layers(pp: int, num_layers: int, overrides: dict) -> list[list[int]]:
    """What Megatron's own layer split gives each stage of a ``2p``-stage pipeline (its offset and count
    functions on a config built for that pipeline)."""
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = tiny_models.transformer_config(dataclasses.replace(GPT, num_layers=num_layers), 2 * pp, **overrides)
    return [list(range(get_transformer_layer_offset(config, None, s),
                       get_transformer_layer_offset(config, None, s) + get_num_layers_to_build(config, None, s)))
            for s in range(2 * pp)]


def _built_layers(pp: int, ctx) -> dict:
    """Each split's V chunks on this rank, built from the tiny model's plain provider: the layer numbers
    Megatron gave their layers, per chunk."""
    out = {}
    for name, (case_pp, num_layers, overrides) in SPLITS.items():
        if case_pp != pp:
            continue
        spec = compare.StepSpec(dataclasses.replace(GPT, num_layers=num_layers), 2, placement="v",
                                config_overrides=overrides)
        _, chunks, _ = compare.build(spec, pp, 2)
        out[name] = [[layer.layer_number - 1 for layer in chunk.decoder.layers] for chunk in chunks]
    return out


@functools.lru_cache(maxsize=None)
def _built(pp: int) -> list:
    return run_on_gloo(functools.partial(_built_layers, pp), ParallelLayout(pp, vpp=2), timeout_s=300)


@pytest.mark.parametrize("name", list(SPLITS))
def test_each_v_chunk_holds_the_layers_megatron_assigns_its_stage(name):
    from primuspipe.ir.placement import Placement

    pp, num_layers, overrides = SPLITS[name]
    want = _megatron_stage_layers(pp, num_layers, overrides)
    assert [layer for stage in want for layer in stage] == list(range(num_layers))
    if name in KNOWN:
        assert want == KNOWN[name]
    placement = Placement.vshape(pp)
    got = {placement.stage(rank, chunk): layers for rank, per_rank in enumerate(_built(pp))
           for chunk, layers in enumerate(per_rank[name])}
    assert [got[s] for s in range(2 * pp)] == want


@pytest.mark.parametrize("pp,num_layers,overrides,match", [
    (4, 12, {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2},
     "cannot split num_layers=12 over 8 stages"),
    (2, 8, {"pipeline_model_parallel_layout": "Et*2|t*2|t*2|t*2L"}, "cannot take pipeline_model_parallel_layout"),
])
def test_splits_the_v_cannot_hold_are_refused_in_one_line(pp, num_layers, overrides, match):
    """Megatron accepts these for its interleaved placement (pp=4, vpp=2: 2 + 4 + 4 + 2 layers per rank),
    but the V's 8 stages cannot hold 2 + 8/6 + 2."""
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
    from primuspipe.backends.megatron.v_placement import v_stage_layers

    enable_cpu_mode()
    config = tiny_models.transformer_config(dataclasses.replace(GPT, num_layers=num_layers), pp, 2, **overrides)
    with pytest.raises(ConfigError, match=match) as refused:
        v_stage_layers(config, pp)
    assert "\n" not in str(refused.value)


VMIN = dataclasses.replace(GPT, num_layers=10)
"""Untied: at pp=1 a tied weight is one parameter whose gradient adds the output layer's and the
embedding's per microbatch, while any pipeline sums two copies' totals -- another order of float adds
(the second step's losses then differ by ~4e-6; tied V runs are compared with Megatron's pipelined
schedule instead, in test_distributed_optimizer.py and test_feature_matrix.py)."""
VMIN_SPLIT = {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}
STEPS, M = 2, 4


def _spec_for(placement, overrides):
    return lambda it: compare.StepSpec(VMIN, M, seed=it, ddp=True, placement=placement, config_overrides=overrides)


@pytest.mark.slow
def test_v_min_pp4_uneven_first_last_trains_equal_to_the_pp1_reference():
    """10 layers at pp=4 with the V's first and last stage holding 2 (Megatron refuses this split for its
    interleaved placement: 3 layers per middle rank do not divide into 2 chunks): losses of two SGD steps
    and every final parameter bitwise equal to Megatron's pp=1 run."""

    def ours(ctx):
        schedule = PrimusForwardBackward(PrimusPipeConfig(True, "v-min"))
        result = compare.train(schedule, _spec_for("v", VMIN_SPLIT), 4, 2, STEPS)
        return result.losses, result.params

    def reference(ctx):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        result = compare.train(get_forward_backward_func(), _spec_for("interleaved", {}), 1, 1, STEPS)
        return result.losses, result.params

    runs = run_on_gloo(ours, ParallelLayout(4, vpp=2), timeout_s=300)
    ((want_losses, want_params),) = run_on_gloo(reference, ParallelLayout(1), timeout_s=300)
    got_losses = [losses for losses, _ in runs if any(losses)]
    assert len(got_losses) == 1, "loss dicts on the last pipeline rank only"
    for got, want in zip(got_losses[0], want_losses, strict=True):
        assert [d["lm loss"].tolist() for d in got] == [d["lm loss"].tolist() for d in want]
    assert_same_tensors(compare.merge_ranks(params for _, params in runs), want_params, "params", bitwise=True)


def _stage_queries() -> list[tuple[bool, bool]]:
    """Megatron's per-chunk stage queries, as a Megatron-LM script's ``get_batch`` asks them."""
    from megatron.core import parallel_state

    return [(parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
             parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c)) for c in (0, 1)]


def _through_get_model(ctx) -> dict:
    """install(zbv), then megatron.training's own get_model (DDP, distributed optimizer) on the tiny model's
    plain provider, then three train_step calls; beside it the same model built by compare.build."""
    from megatron.core import parallel_state
    from megatron.training import get_args, training

    from primuspipe.backends.megatron.install import install, uninstall
    from primuspipe.testing.megatron import train_step

    spec = compare.StepSpec(GPT, M, ddp=True, placement="v", optimizer="adam", lr=0.01,
                            ddp_overrides={"use_distributed_optimizer": True, "overlap_grad_reduce": True})
    train_step._set_globals(spec, parallel_state.get_data_parallel_world_size())
    get_args().virtual_pipeline_model_parallel_size = 2
    schedule = install(PrimusPipeConfig(True, "zbv"))
    try:
        config = tiny_models.transformer_config(GPT, 2, 2, placement="v")
        model = training.get_model(tiny_models.model_provider(GPT, config))
        queries = _stage_queries()
    finally:
        uninstall()
    out = {"pp_rank": ctx.pp_rank, "flags": [(m.module.pre_process, m.module.post_process) for m in model],
           "queries": queries, "queries_after_uninstall": _stage_queries(),
           "layers": [[layer.layer_number - 1 for layer in m.module.decoder.layers] for m in model]}
    for m in model:
        tiny_models.fill_parameters(m.module, spec.seed)
    config.no_sync_func = [m.no_sync for m in model]
    config.grad_sync_func = [m.start_grad_sync for m in model]
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    optimizer = compare.make_optimizer(spec, model)
    losses = []
    for it in range(STEPS):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        out_, _ = compare.call_schedule(schedule, dataclasses.replace(spec, seed=it), model)
        optimizer.step()
        losses.append([d["lm loss"].tolist() for d in out_])
    out["losses"] = losses
    reference = compare.train(PrimusForwardBackward(PrimusPipeConfig(True, "zbv")),
                              lambda it: dataclasses.replace(spec, seed=it), 2, 2, STEPS)
    out["reference"] = [[d["lm loss"].tolist() for d in step] for step in reference.losses]
    return out


@pytest.mark.slow
def test_install_builds_v_chunks_through_megatrons_get_model():
    """The user's provider is called by megatron.training's get_model as in Megatron-LM; install() alone
    makes the chunks the V's (flags, layers) and Megatron's per-chunk stage queries answer for the V
    (until uninstall), and three DDP + distributed-optimizer steps equal the
    primuspipe-built V bitwise."""
    from primuspipe.ir.placement import Placement

    results = run_on_gloo(_through_get_model, ParallelLayout(2, vpp=2, dp=2), timeout_s=300)
    placement, want = Placement.vshape(2), _megatron_stage_layers(2, GPT.num_layers, {})
    for r in results:
        stages = [placement.stage(r["pp_rank"], chunk) for chunk in (0, 1)]
        assert r["layers"] == [want[s] for s in stages]
        assert r["flags"] == [(s == 0, s == 3) for s in stages]
        assert r["queries"] == r["flags"], "the script's data pipeline feeds the V's first and last stage"
        assert r["queries_after_uninstall"] == [(r["pp_rank"] == 0 and c == 0, r["pp_rank"] == 1 and c == 1)
                                                 for c in (0, 1)], "Megatron's own answers back"
        assert r["losses"] == r["reference"]
    assert any(r["losses"][0] for r in results), "the loss rank reports"
