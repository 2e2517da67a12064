"""Which Megatron settings a primuspipe table can run with, checked before anything runs.

Each refusal is a :class:`~primuspipe.errors.ConfigError` naming the flag, why it conflicts and what
to do. Settings that only choose *how Megatron's own schedules* communicate (``batch_p2p_comm``,
``overlap_p2p_comm``, ``overlap_p2p_comm_warmup_flush``, ``use_ring_exchange_p2p``) are not errors:
the table decides the communication, which is always unbatched, ordered and non-blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from primuspipe.errors import ConfigError
from primuspipe.ir.node import NodeKind
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable

_UNSUPPORTED_FLAGS: tuple[tuple[str, str], ...] = (
    ("variable_seq_lengths",
     "receives are posted ahead of their consumer with a fixed (seq, micro_batch, hidden) shape, while "
     "variable_seq_lengths makes Megatron exchange shapes in a blocking handshake before each transfer"),
    ("mtp_standalone",
     "standalone multi-token-prediction stages exchange tensor shapes before each transfer, like "
     "variable_seq_lengths"),
    ("overlap_moe_expert_parallel_comm",
     "it asks for Megatron's combined 1F1B (pipeline_parallel/combined_1f1b.py), which overlaps one "
     "microbatch's forward with another's backward layer by layer on separate compute and expert-parallel "
     "communication streams through per-microbatch schedule plans (build_schedule_plan, "
     "combined_forward_backward_step) and calls the layers' backward_dw itself; primuspipe's FB nodes run "
     "their F and then their B through forward_step/backward_step on one stream, and the binder has no "
     "handler that builds those plans or runs the two halves on two streams, so nothing would overlap. "
     "For weight-gradient deferral alone, set delay_wgrad_compute without it (te_deferral."
     "enable_delay_wgrad_compute, docs/megatron.md)"),
    ("num_microbatches_with_partial_activation_checkpoints",
     "Megatron picks the microbatches to checkpoint from its own warm-up counts, which a primuspipe table "
     "does not have; use recompute settings that apply to every microbatch"),
)


def check_megatron_config(config: Any, table: ScheduleTable, models: Sequence[Any], rank: int = 0) -> None:
    """Refuse Megatron settings and tables this backend cannot run correctly (``models``: pipeline rank
    ``rank``'s chunks)."""
    for flag, why in _UNSUPPORTED_FLAGS:
        value = getattr(config, flag, None)
        if value not in (None, False, 0):
            raise ConfigError(f"Megatron's {flag}={value!r} is not supported by primuspipe's schedules: {why}. "
                              f"Unset {flag} or turn patch_primus_pipeline off.")
    if (cp := getattr(config, "context_parallel_size", 1) or 1) > 1:
        raise ConfigError(
            f"Megatron's context_parallel_size={cp} is not supported by primuspipe's schedules yet: running it needs "
            "megatron-core's context-parallel attention (Transformer Engine, GPU), on which no primuspipe table has "
            "been checked against Megatron's schedule (the weight-gradient deferral of B/W tables covers local linear "
            "layers only). Set context_parallel_size=1, or turn patch_primus_pipeline off for this run.")
    if getattr(config, "pipeline_dtype", None) is None:
        raise ConfigError("Megatron's pipeline_dtype is unset; pipeline transfers need it (set it to params_dtype)")
    if len(models) != table.vpp:
        raise ConfigError(f"the model has {len(models)} chunk(s) per rank but the {table.algorithm} table has vpp={table.vpp}")
    _check_placement(table, models, rank)
    _check_multi_token_prediction(table, config, models)
    split = table.splits_backward
    _check_te_deferral(table, config, models, split)
    if split:
        _check_split_backward(table, config, models)
    _check_data_order(table)
    _check_tied_copies(table, models)
    _check_param_gather(models)


def _check_param_gather(models: Sequence[Any]) -> None:
    """Megatron-LM's rule that ``overlap_param_gather`` needs the distributed optimizer (``validate_args``;
    megatron-core's DDP config does not check it): without it, DDP's bucket all-gather over more than one
    data-parallel rank takes the layer-wise optimizer's path, which needs that optimizer's per-rank parameter
    lists, so without one the first parameter sync raises a TypeError inside DDP's forward hook (measured under
    Megatron's schedule: DP = 2 x PP = 2, the first stage's ranks) and the other ranks wait for them. Checked on
    the DDP chunks' buckets, which a layer-wise optimizer (``dist_muon``) gives those lists."""
    for chunk, model in enumerate(models):
        ddp = getattr(model, "ddp_config", None)
        if ddp is None or not ddp.overlap_param_gather or ddp.use_distributed_optimizer or ddp.use_megatron_fsdp:
            continue
        groups = getattr(model, "bucket_groups", []) + getattr(model, "expert_parallel_bucket_groups", [])
        if any(getattr(bucket, "layerwise_params_list", None) is None for group in groups
               if getattr(group, "intra_distributed_optimizer_instance_size", 2) > 1 for bucket in group.buckets):
            raise ConfigError(
                f"Megatron's overlap_param_gather=True on model chunk {chunk} needs the distributed optimizer "
                "(Megatron-LM refuses it otherwise): set use_distributed_optimizer=True in the "
                "DistributedDataParallelConfig (and the OptimizerConfig), or overlap_param_gather=False")


def _check_tied_copies(table: ScheduleTable, models: Sequence[Any]) -> None:
    """Where one rank holds both copies of tied embeddings (the V), they must start equal: chunks built
    outside ``v_layer_offsets`` leave the output layer's copy zeroed (checked once per model)."""
    from primuspipe.backends.megatron.v_placement import tied_copies

    copies = tied_copies(models)
    if copies is None or getattr(copies[1], "_primuspipe_tie_checked", False):
        return
    if not torch.equal(copies[0], copies[1]):
        raise ConfigError(
            f"{table.algorithm}: tied embeddings, but the output layer's copy on this rank differs from the word "
            "embedding; build the V chunks with megatron.training's get_model after install() (or "
            "primuspipe.backends.megatron.v_placement.v_model_provider), which initialises it from the word "
            "embedding (docs/megatron.md)")
    copies[1]._primuspipe_tie_checked = True


def _check_data_order(table: ScheduleTable) -> None:
    """Megatron's ``forward_step_func`` draws the next batch from the chunk's iterator at every call, so
    a chunk's forwards must run in microbatch order for microbatch i to get batch i."""
    for rank, row in enumerate(table.ranks):
        seen: dict[int, int] = {}
        for node in row:
            for kind, mb, chunk in node.parts():
                if kind is NodeKind.F:
                    if mb != seen.get(chunk, -1) + 1:
                        raise ConfigError(
                            f"{table.algorithm}: rank {rank} runs F{mb}.{chunk} out of microbatch order; Megatron's "
                            "data iterators hand out batches in call order, so each chunk's forwards must run in "
                            "microbatch order")
                    seen[chunk] = mb


def _unwrap(model: Any) -> Any:
    """The GPTModel (or other MegatronModule) inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _check_placement(table: ScheduleTable, models: Sequence[Any], rank: int) -> None:
    """Each chunk must hold the stage the table gives it: Megatron builds chunk c of rank r as stage
    c*pp + r (interleaved); V-shape tables need chunks built with ``v_placement``. Chunks that say whether
    they pre-/post-process (GPTModel does) are checked against the table's first and last stage."""
    interleaved = table.placement == Placement.interleaved(table.pp, table.vpp)
    for chunk, model in enumerate(models):
        stage = table.placement.stage(rank, chunk)
        inner = _unwrap(model)
        pre, post = getattr(inner, "pre_process", None), getattr(inner, "post_process", None)
        if pre is None or post is None:
            if interleaved:
                continue
            raise ConfigError(
                f"{table.algorithm} places stages as {table.placement.name!r}, but Megatron builds model chunk c of "
                "pipeline rank r as stage c*pp + r (interleaved) and this model does not say which stage its chunks "
                "hold; build the chunks with primuspipe.backends.megatron.v_placement (see docs/megatron.md)")
        want = (stage == 0, stage == table.num_stages - 1)
        if (bool(pre), bool(post)) != want:
            how = ("build them with megatron.training's get_model after install(), or wrap the model provider with "
                   "primuspipe.backends.megatron.v_placement.v_model_provider (docs/megatron.md, 'V placement')"
                   if not interleaved else "build them as Megatron does (interleaved placement)")
            raise ConfigError(
                f"{table.algorithm} places stage {stage} ({table.placement.name} placement) on pipeline rank {rank} "
                f"chunk {chunk}, but that chunk was built with pre_process={pre}, post_process={post} (stage 0 "
                f"pre-processes, stage {table.num_stages - 1} post-processes); {how}")


def _check_multi_token_prediction(table: ScheduleTable, config: Any, models: Sequence[Any]) -> None:
    """Multi-token prediction (``mtp_num_layers``): Megatron builds the MTP block with the last stage,
    with its own copy of the word embedding that it keeps equal to the first stage's through the
    embedding group (first and last pipeline rank)."""
    if not getattr(config, "mtp_num_layers", None):
        return
    if table.placement != Placement.interleaved(table.pp, table.vpp):
        raise ConfigError(
            f"{table.algorithm} places stages in a V, but mtp_num_layers={config.mtp_num_layers}: the MTP block's "
            "embedding copy would sit on rank 0 beside the word embedding, and Megatron keeps the two equal through "
            "its embedding group (first and last pipeline rank), which the V does not route; use a table with "
            "Megatron's placement (1f1b, interleaved-1f1b, zb-h1, zb-h2) or unset mtp_num_layers")
    split = table.splits_backward
    tied = any(getattr(_unwrap(m), "share_embeddings_and_output_weights", False) for m in models)
    if split and tied and getattr(config, "gradient_accumulation_fusion", False):
        raise ConfigError(
            f"{table.algorithm} defers weight GEMMs to W nodes, but mtp_num_layers={config.mtp_num_layers} with tied "
            "embeddings and gradient_accumulation_fusion: on the last stage the output layer and the MTP embedding "
            "share one weight, whose gradient Megatron marks as already in main_grad (grad_added_to_main_grad, kept "
            "for the whole step) once the output layer's GEMM ran, after which the embedding lookup's gradient is "
            "not added; a W runs that GEMM at another point than the fused backward, so the embedding gradient "
            "differs from Megatron's schedule (2e-3 measured). Untie the embeddings, turn "
            "gradient_accumulation_fusion off, or use a fused-backward schedule (1f1b, interleaved-1f1b)")


def _check_split_backward(table: ScheduleTable, config: Any, models: Sequence[Any]) -> None:
    """Tables with ``B``/``W`` nodes defer weight gradients (``wgrad_store``, ``te_deferral``)."""
    from primuspipe.backends.megatron.te_deferral import te_weight_gemm

    grouped = any(te_weight_gemm(m) == "GroupedLinear" for model in models if isinstance(model, torch.nn.Module)
                  for m in model.modules())
    if getattr(config, "moe_grouped_gemm", False) and not grouped:
        raise ConfigError(
            f"{table.algorithm} splits the backward into B and W nodes and moe_grouped_gemm=True asks for grouped-GEMM "
            "experts, but the model has none (the local layer spec ignores the flag and builds SequentialMLP). Build "
            "the experts with Transformer Engine's spec (TEGroupedMLP) and delay_wgrad_compute, or set "
            "moe_grouped_gemm=False")


def _check_te_deferral(table: ScheduleTable, config: Any, models: Sequence[Any], split: bool) -> None:
    """Transformer Engine layers: refuse what cannot defer (``wgrad_store.check_deferrable``); where TE's
    per-module FIFO stores are used, each chunk's weight-gradient nodes must pop them in order."""
    from primuspipe.backends.megatron.wgrad_store import check_deferrable
    from primuspipe.passes.fifo_weight_grads import check_fifo_weight_grads

    if check_deferrable([_unwrap(m) for m in models], config, split):
        check_fifo_weight_grads(table)
