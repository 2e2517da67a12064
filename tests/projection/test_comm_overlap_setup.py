"""The published Megatron-Bridge and NeMo 2 rows carry what the comm-overlap setup left in the run, not the
recipe's base values.

Megatron-Bridge builds a run's config in two layers: the recipe function (and the performance scripts' functions
over it) writes the model, DDP and optimizer configs, and then ``runtime_config_update``
(``src/megatron/bridge/training/config.py``) calls ``CommOverlapConfig.setup``, which overwrites their overlap fields
with defaults of its own (``training/comm_overlap.py``) wherever the field was not given to the ``CommOverlapConfig``
itself (``_override_user_cfgs``: a value set directly on ``cfg.ddp`` or ``cfg.model`` does not count). So a row must
not copy a recipe's ``cfg.ddp.overlap_grad_reduce = False``: at DP > 1 the run overlapped it (the eighteenth session
found five SFT rows that did). NeMo 2's ``MegatronCommOverlapCallback`` (``nemo/lightning/pytorch/callbacks/
megatron_comm_overlap.py``), which every performance-mode recipe installs, applies the same defaults the same way
in its ``setup``. The defaults, the same at every release in the table:

- data parallel (``_get_optimizer_overlap_cfgs``, applied only with the distributed optimizer): at DP > 1
  ``overlap_grad_reduce`` and ``overlap_param_gather`` on, ``bucket_size`` 128 Mi parameters, and
  ``align_param_gather`` with PP > 1 and VP > 1; at DP 1 all off;
- model (``_get_model_comm_overlap_cfgs``): ``defer_embedding_wgrad_compute`` off (``wgrad_deferral_limit`` -1) and
  ``tp_comm_overlap`` off unless given; a given ``tp_comm_overlap`` is dropped at TP < 2 or without sequence
  parallelism. (Its pipeline defaults, ``overlap_p2p_comm`` with VP > 1 else ``batch_p2p_comm``, have no field.)

What the user gave is :data:`USER_VALUES`, each with the line that gives it. The check covers every field the
projection prices; ``align_param_gather`` and ``ddp_bucket_size`` only price where each bucket's gather shows (no
interleaved schedule, :func:`~primuspipe.projection.comm.gradient_sync`), so they are checked there and wherever a
row states them. MoE rows are held to the same rule (none differs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from published_rows import shipped_runs
from primuspipe.projection.published import PublishedRun
from primuspipe.projection.training_spec import TrainingSpec

RELEASES = {
    "mbridge2509-": "v0.1.0rc4 (6725f7049): config.py line 1128 calls setup; comm_overlap.py lines 436-437, 444, "
                    "542-549",
    "mbridge2511-": "v0.2.0 (7af9601c9): config.py line 1455; comm_overlap.py lines 433-434, 441, 539-546",
    "mbridge2602-": "v0.3.0 (21b02e0cf): config.py line 1698; comm_overlap.py lines 433-434, 441, 539-546",
    "mbridge260201-": "cfeddcd94: config.py line 2041; comm_overlap.py lines 436-437, 444, 576-583",
    "mbridge2604-": "v0.4.0 (0fbfe7d3e): config.py line 1561; comm_overlap.py lines 436-437, 444, 576-583",
    "mbridge260401-": "21d102f5e: config.py line 1697; comm_overlap.py lines 436-437, 444, 563-570",
    "mbridge2606-": "v0.5.0 (fcbb60311) and 8f341b04f: config.py line 1697 / 1726; comm_overlap.py lines 436-437, 444, "
                    "563-570",
    "nemo2502-": "NVIDIA/NeMo c80bd5c0c6 (the 25.02 rows' tree) and v2.2.0: megatron_comm_overlap.py lines 138-139, "
                 "144, 185-192, 277",
    "dgxc2504-": "NVIDIA/NeMo d2b21556f2 (dgxc-benchmarking v25.04.01's setup.sh): megatron_comm_overlap.py lines "
                 "138-139, 144, 185-192, 277",
    "dgxc2505-gb200-llama3.1-": "NVIDIA/NeMo 7a8f1cc7bc (dgxc-benchmarking v25.05's llama3.1 setup.sh): "
                                "megatron_comm_overlap.py lines 138-139, 144, 185-192, 277",
    "dgxc2505-gb200-nemotron4-": "NVIDIA/NeMo b4148d2169 (dgxc-benchmarking v25.05's nemotron setup.sh): "
                                 "megatron_comm_overlap.py lines 138-139, 144, 185-192, 277",
}
"""Each release in the table (by row-id prefix) and where its tree holds the call to the setup and the defaults above
(model defaults, the TP check, the DP > 1 branch; Megatron-Bridge's ``training/config.py`` and ``training/
comm_overlap.py`` in NVIDIA-NeMo/Megatron-Bridge). A Megatron-Bridge row of a release not listed fails until its tree
is read. Not held to it: NeMo 2 rows whose page names no script (NeMo 25.04's long-sequence rows) and
dgxc-benchmarking v25.05.05's DeepSeek-V3 (MoE)."""


def _defer(limit: int) -> dict[str, Any]:
    return {"defer_embedding_wgrad_compute": True, "wgrad_deferral_limit": limit}


USER_VALUES: dict[str, dict[str, Any]] = {
    # v0.1.0rc4 scripts/performance/run_script.py lines 99-102: DeepSeek-V3 on H100 sets overlap_grad_reduce False
    "mbridge2509-deepseek-v3-fp8-1024": {"overlap_grad_reduce": False},
    # v0.1.0rc4 run_script.py line 52 builds the recipe without a comm_overlap_config, so
    # src/megatron/bridge/recipes/llama/llama3_70b.py lines 219-227 install one deferring with limit 22
    "mbridge2509-llama3-70b-fp8cs-64": _defer(22),
    # v0.2.0 scripts/performance/configs/qwen3/qwen3_llm_pretrain.py lines 133-136 (qwen3_235b_a22b_b200_config,
    # fp8_mx)
    "mbridge2511-b200-qwen3-235b-a22b-mxfp8-64": {"overlap_param_gather": False},
    # v0.2.0 scripts/performance/configs/llama31/llama31_llm_pretrain.py lines 140-143 (llama31_405b_b200_config,
    # fp8_mx)
    "mbridge2511-b200-llama3.1-405b-mxfp8-128": {"overlap_param_gather": False},
    # the SFT functions' CommOverlapConfig(..., defer_embedding_wgrad_compute=True, wgrad_deferral_limit=22):
    # fcbb60311 / 8f341b04f scripts/performance/configs/llama/llama3_llm_finetune.py lines 121-124 (GB300), 157-160
    # (GB200), 187-190 (H100)
    **{row: _defer(22) for row in ("mbridge2606-gb300-llama3-70b-sft-fp8cs-32",
                                   "mbridge2606-gb300-llama3-70b-sft-mxfp8-32",
                                   "mbridge2606-gb200-llama3-70b-sft-fp8cs-32",
                                   "mbridge2606-gb200-llama3-70b-sft-mxfp8-32", "mbridge2606-llama3-70b-sft-fp8cs-32")},
    # NeMo 2 recipes' pretrain_performance_optimizations callbacks (the same lines at v2.2.0 and d2b21556f2):
    # nemo/collections/llm/recipes/llama3_70b.py lines 234-235 (dgxc's pretrain_llama31.py takes the llama3_70b
    # recipe for 70B, v25.04.01 line 33), llama31_405b.py 241-242, nemotron4_340b.py 214-215, gpt3_175b.py 232-233
    # (the same lines at 7a8f1cc7bc and b4148d2169, dgxc-benchmarking v25.05's trees)
    **{row: _defer(22) for row in ("dgxc2504-llama3.1-70b-fp8-64", "nemo2502-b200-llama3-70b-fp8-64",
                                   "dgxc2504-nemotron4-340b-bf16-256", "dgxc2504-nemotron4-340b-fp8-256",
                                   "nemo2502-b200-nemotron4-340b-fp8-128", "dgxc2505-gb200-nemotron4-340b-bf16-128",
                                   "dgxc2505-gb200-nemotron4-340b-fp8-512",
                                   "dgxc2505-gb200-nemotron4-340b-bf16-512-gbs512")},
    **{row: _defer(50) for row in ("dgxc2504-llama3.1-405b-bf16-512", "dgxc2504-llama3.1-405b-fp8-512",
                                   "nemo2502-b200-llama3.1-405b-fp8-128", "nemo2502-b200-gpt3-175b-fp8-512",
                                   "nemo2502-h100-gpt3-175b-fp8-512", "dgxc2505-gb200-llama3.1-405b-bf16-128",
                                   "dgxc2505-gb200-llama3.1-405b-bf16-512", "dgxc2505-gb200-llama3.1-405b-fp8-512")},
}
"""Fields the run's code gave to the ``CommOverlapConfig`` (or the callback), which take precedence over the defaults:
row id -> {field: value}."""

BUCKET = 128 * 1024 * 1024


def _release(run: PublishedRun) -> str:
    return next(prefix for prefix in RELEASES if run.id.startswith(prefix))


def expected(run: PublishedRun) -> dict[str, Any]:
    """The checked fields as the setup leaves them for ``run`` (:data:`USER_VALUES` over the defaults)."""
    t = run.training
    tp, pp = t.get("tensor_model_parallel_size", 1), t.get("pipeline_model_parallel_size", 1)
    vp = t.get("virtual_pipeline_model_parallel_size") or 1
    dp = run.gpus // (tp * pp * t.get("context_parallel_size", 1))
    values: dict[str, Any] = {"defer_embedding_wgrad_compute": False}
    if t.get("use_distributed_optimizer", TrainingSpec.use_distributed_optimizer):
        values |= {"overlap_grad_reduce": dp > 1, "overlap_param_gather": dp > 1,
                   "align_param_gather": dp > 1 and pp > 1 and vp > 1, "ddp_bucket_size": BUCKET if dp > 1 else None}
    return values | USER_VALUES.get(run.id, {})


def mismatches(run: PublishedRun) -> list[str]:
    """Each priced or stated field where ``run`` says other than the run's code left it, as 'field: row -> code'."""
    t, want, defaults = run.training, expected(run), TrainingSpec()
    priced = {"overlap_grad_reduce", "overlap_param_gather", "defer_embedding_wgrad_compute", "wgrad_deferral_limit"}
    if (t.get("virtual_pipeline_model_parallel_size") or 1) == 1:  # each bucket's gather shows where it is aligned
        priced |= {"align_param_gather"} | ({"ddp_bucket_size"} if want.get("align_param_gather") else set())
    found = [f"{field}: {t.get(field, getattr(defaults, field))} -> {value}" for field, value in want.items()
             if (field in priced or field in t) and t.get(field, getattr(defaults, field)) != value]
    if t.get("tp_comm_overlap") and not (t.get("tensor_model_parallel_size", 1) > 1 and t.get("sequence_parallel")):
        found.append("tp_comm_overlap: True -> False (setup drops it at TP < 2 or without sequence parallelism)")
    return found


RUNS = shipped_runs()
ROWS = [run for run in RUNS if run.id.startswith(tuple(RELEASES))]


def test_every_bridge_row_names_a_release_whose_setup_was_read():
    assert len(ROWS) > 70
    assert not [run.id for run in RUNS if run.id.startswith("mbridge") and run not in ROWS]
    assert USER_VALUES.keys() <= {run.id for run in ROWS}


@pytest.mark.parametrize("run", ROWS, ids=[run.id for run in ROWS])
def test_the_row_carries_what_setup_left(run: PublishedRun):
    assert not mismatches(run), f"{run.id} ({RELEASES[_release(run)]}): {mismatches(run)}"


def test_the_rule_catches_a_row_that_copies_the_base_recipe():
    """A 26.06 SFT row as the five were first written (the base recipe's ``cfg.ddp`` flags, False) and without its
    deferral, and the 25.11 B200 405B MXFP8 row with the default its performance function overrides."""
    sft = next(run for run in ROWS if run.id == "mbridge2606-gb300-llama3-70b-sft-fp8cs-32")
    copied = {**sft.training, "overlap_grad_reduce": False, "overlap_param_gather": False}
    assert [m.split(":")[0] for m in mismatches(_with(sft, copied))] == ["overlap_grad_reduce", "overlap_param_gather"]
    mxfp8 = next(run for run in ROWS if run.id == "mbridge2511-b200-llama3.1-405b-mxfp8-128")
    assert mismatches(_with(mxfp8, {**mxfp8.training, "overlap_param_gather": True}))
    undeferred = {k: v for k, v in sft.training.items()
                  if k not in ("defer_embedding_wgrad_compute", "wgrad_deferral_limit")}
    assert mismatches(_with(sft, undeferred))[0].startswith("defer_embedding_wgrad_compute")


def _with(run: PublishedRun, training: dict[str, Any]) -> PublishedRun:
    return dataclasses.replace(run, training=training)
