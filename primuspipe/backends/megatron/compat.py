"""Which Megatron settings a primuspipe table can run with, checked before anything runs.

Each refusal is a :class:`~primuspipe.errors.ConfigError` naming the flag, why it conflicts and what
to do. Settings that only choose *how Megatron's own schedules* communicate (``batch_p2p_comm``,
``overlap_p2p_comm``, ``overlap_p2p_comm_warmup_flush``, ``use_ring_exchange_p2p``) are not errors:
the table decides the communication, which is always unbatched, ordered and non-blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from primuspipe.errors import ConfigError
from primuspipe.node import NodeKind
from primuspipe.placement import Placement
from primuspipe.table import ScheduleTable

_UNSUPPORTED_FLAGS: tuple[tuple[str, str], ...] = (
    ("variable_seq_lengths",
     "receives are posted ahead of their consumer with a fixed (seq, micro_batch, hidden) shape, while "
     "variable_seq_lengths makes Megatron exchange shapes in a blocking handshake before each transfer"),
    ("mtp_standalone",
     "standalone multi-token-prediction stages exchange tensor shapes before each transfer, like "
     "variable_seq_lengths"),
    ("overlap_moe_expert_parallel_comm",
     "Megatron's combined 1F1B path overlaps the forward of one microbatch with the backward of another "
     "inside its own schedule; a primuspipe table would express that as overlapped F+B nodes, which this "
     "binder does not run"),
    ("num_microbatches_with_partial_activation_checkpoints",
     "Megatron picks the microbatches to checkpoint from its own warm-up counts, which a primuspipe table "
     "does not have; use recompute settings that apply to every microbatch"),
)


def check_megatron_config(config: Any, table: ScheduleTable, models: Sequence[Any]) -> None:
    """Refuse Megatron settings and tables this backend cannot run correctly."""
    for flag, why in _UNSUPPORTED_FLAGS:
        value = getattr(config, flag, None)
        if value not in (None, False, 0):
            raise ConfigError(f"Megatron's {flag}={value!r} is not supported by primuspipe's schedules: {why}. "
                              f"Unset {flag} or turn patch_primus_pipeline off.")
    if getattr(config, "pipeline_dtype", None) is None:
        raise ConfigError("Megatron's pipeline_dtype is unset; pipeline transfers need it (set it to params_dtype)")
    if table.placement != Placement.interleaved(table.pp, table.vpp):
        raise ConfigError(
            f"{table.algorithm} places stages as {table.placement.name!r}, but Megatron builds model chunk c of "
            "pipeline rank r as stage c*pp + r (interleaved); use an algorithm with the interleaved placement")
    if len(models) != table.vpp:
        raise ConfigError(f"the model has {len(models)} chunk(s) per rank but the {table.algorithm} table has vpp={table.vpp}")
    has_w = any(n.kind in (NodeKind.W, NodeKind.B, NodeKind.FB) for _, _, n in table.positions())
    if has_w:
        for model in models:
            ddp = getattr(model, "ddp_config", None)
            for flag in ("overlap_grad_reduce", "overlap_param_gather"):
                if ddp is not None and getattr(ddp, flag, False):
                    raise ConfigError(
                        f"{table.algorithm} splits the backward into B and W nodes, but DDP's {flag}=True: with "
                        "split weight gradients a parameter's gradient is complete only after its last W, while "
                        f"{flag} starts bucket communication from Megatron's backward hooks and 'last "
                        "microbatch' flag, which assume a fused backward. Set "
                        f"{flag}=False with split-backward schedules.")
    _check_data_order(table)


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
