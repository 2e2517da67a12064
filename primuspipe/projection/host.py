"""Host-side time of a layer: the CPU issuing its kernels, which the GPU cannot run ahead of.

A training step runs eagerly: Python walks megatron-core's modules and every operation is dispatched
through PyTorch (and Transformer Engine) before its kernel is queued. The GPU overlaps that with the
kernels already queued, so a layer costs its device time unless the host issues its work more slowly
than the GPU runs it -- small, fine-grained MoE layers (many experts per rank, few tokens each) do.
Then the layer takes the host's time.

The host's work per layer is counted in two units, each priced by the hardware file (the host CPU the
accelerator ships with):

* **framework ops** (``host_op_seconds``): operations dispatched from Python, priced by a measured
  ``torch.nn.Linear`` forward on the host (a Python call through PyTorch's dispatcher into one kernel).
  Transformer Engine's modules cost more than one: its ``Linear`` forward took 2.7 times
  ``torch.nn.Linear``'s host time on one host (99.66 against 37.08 us, TransformerEngine issue 2053), and
  an FP8 ``Linear`` more than twice a BF16 one (TransformerEngine issue 761: casts, scales, amax
  bookkeeping) -- 3 and 6 ops here. Backward, autograd runs a node per forward op; a linear layer's
  backward is two GEMMs with their casts (input gradient in B, weight gradient in W), each as costly to
  issue as the forward.
* **kernel launches** (``host_launch_seconds``): kernels a C++ loop issues without Python, one per
  expert in Transformer Engine's ``GroupedLinear`` (its grouped GEMM runs one cuBLAS GEMM per expert,
  and under FP8 one cast per expert's input).

What each layer issues is counted from megatron-core 0.19's code path (:data:`OPS`). The counts are a
structural estimate -- a profile of a real step would replace them -- but their inputs (module count,
experts per rank, FP8, the dispatcher, CUDA graphs) are the ones that decide when the host binds.

**Synchronisation.** The MoE dispatchers of dropless routing need the token counts on the host before
they can size the all-to-all and the expert GEMMs: megatron-core's ``MoEAlltoAllTokenDispatcher`` copies
them to the host and waits for that copy (``_maybe_dtoh_and_synchronize``: ``d2h_event.synchronize()``
at ``cuda_sync_point``), the all-gather dispatcher calls ``.cpu()``, DeepEP returns them to the host.
The host cannot run past that point, so the GPU's queue is empty after it: each forward MoE layer takes
max(host, device) on its own. With ``moe_pad_expert_input_to_capacity`` every size is known in advance
and nothing waits (``_maybe_dtoh_and_synchronize`` does nothing when ``drop_and_pad``); without a sync
the host runs ahead over the passes, and a pass is slowed only by what the host takes over all of them.

**CUDA graphs** (``cuda_graph_impl`` local / transformer_engine with ``cuda_graph_modules``): a captured
region replays with one graph launch instead of its ops, forward and backward. Megatron captures the
MoE part only when padded to capacity, and the pre-processing only with the router; ``full_iteration``
captures the whole step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.training_spec import RankShape, TrainingSpec

TE_LINEAR_OPS = {False: 3.0, True: 6.0}
"""Framework ops one Transformer Engine linear module's forward costs the host, BF16 and FP8 (see above)."""

OPS = {
    "attn": 3 + 2 + 1,        # core attention (a TE module), RoPE on queries and keys, bias-dropout-add
    "qk_norm": 2,             # per-head query and key norms
    "mlp": 1 + 1,             # activation, bias-dropout-add
    "moe_norm": 1,            # the pre-MLP norm (the router reads its output, so it is not fused into fc1)
    "moe_gating": 1,          # the router's gating GEMM
    "moe_score_topk": 4,      # score function and top-k
    "moe_aux_loss": 3,        # auxiliary-loss bookkeeping
    "moe_preprocess": 10,     # token counts per expert and rank, their all-gather, the split sizes
    "moe_dtoh": 6,            # the split sizes' copies to the host (dropless only)
    "moe_permute": 3,         # permute the copies into expert order
    "moe_dispatch": 2,        # all-to-all of the tokens and of their probabilities
    "moe_sort": 2,            # sort received copies by local expert (more than one local expert), and back
    "moe_experts": 2,         # the experts' activation (weighted by the routing probabilities)
    "moe_fp8_padding": 3,     # under FP8 where counts arrive unaligned: pad copies and probabilities, unpad output
    "moe_unpermute": 2,       # unpermute the returned copies
    "moe_combine": 1 + 1,     # all-to-all back; bias-dropout-add
    "shared_expert": 1,       # the shared expert's activation (its two linears are counted as linears)
    "expert_bias": 2 + 1 + 1, # with add_bias_linear: split output and probabilities, concatenate, cast back
    "expert_bias_each": 2,    # ... and per local expert: bias x probability, added to the expert's slice
}
"""Framework ops of one layer's forward besides its linear modules, by region; each has one autograd node
backward (in B). A fused kernel replaces a group by one op (:func:`moe_op_counts`)."""


def moe_op_counts(training: TrainingSpec) -> dict[str, float]:
    """:data:`OPS` as ``training``'s fusions leave them: each fused group is one op.

    * ``moe_router_fusion`` (megatron-core's fused top-k): score function and top-k one op;
      Primus-Turbo's ``moe_use_fused_router_with_aux_score`` (``primus/backends/megatron/core/transformer/moe/
      router.py``, ``fused_router_and_auxiliary_loss``): the auxiliary loss's scores in the same op;
    * ``moe_permute_fusion`` (Transformer Engine's ``moe_permute`` / ``moe_unpermute`` / ``moe_sort_chunks_by_index``
      in megatron-core's ``moe_utils``): each permutation, sort and unpermutation one op;
    * ``use_turbo_fused_act_with_probs`` (Primus's ``PrimusGroupedMLP``): activation and weighting one op."""
    t = training
    ops = dict(OPS)
    if t.moe_router_fusion or t.moe_use_fused_router_with_aux_score:
        ops["moe_score_topk"] = 1
    if t.moe_use_fused_router_with_aux_score:
        ops["moe_aux_loss"] = 0
    if t.moe_permute_fusion:
        ops.update(moe_permute=1, moe_sort=1, moe_unpermute=1)
    if t.use_turbo_fused_act_with_probs:
        ops["moe_experts"] = 1
    return ops


@dataclass(frozen=True)
class HostWork:
    """What the host issues for one pass of a layer."""

    ops: float = 0.0
    launches: float = 0.0

    def seconds(self, op_seconds: float, launch_seconds: float) -> float:
        return self.ops * op_seconds + self.launches * launch_seconds


@dataclass(frozen=True)
class LayerHost:
    """Host work of a layer's forward, input-gradient and weight-gradient passes, and whether its forward
    waits for the GPU (a device-to-host sync)."""

    forward: HostWork
    backward_input: HostWork
    backward_weight: HostWork
    syncs: bool

    def seconds(self, hardware: HardwareSpec) -> tuple[float, float, float]:
        """Each pass's host seconds: the ops of a syncing layer at ``moe_sync_host_op_seconds`` where the hardware
        file gives it, every other layer's at ``host_op_seconds``; launches at ``host_launch_seconds``."""
        sync_op = hardware.moe_sync_host_op_seconds if self.syncs else None
        op = sync_op if sync_op is not None else hardware.host_op_seconds or 0.0
        launch = hardware.host_launch_seconds or 0.0
        return tuple(w.seconds(op, launch) for w in (self.forward, self.backward_input, self.backward_weight))


def waits_for_token_counts(training: TrainingSpec, kind: str) -> bool:
    """Whether a layer of ``kind``'s forward waits for the GPU: a dropless MoE dispatch copies the token counts
    to the host, even at EP 1 (``before_finish``); padded to capacity every size is known in advance. Primus's
    sync-free stage 1 (fused router and permutation) keeps the wait: its DeepEP dispatch still busy-waits for
    the received counts (``PrimusTurboDeepEPTokenDispatcher``: ``num_worst_tokens`` is 0 below stage 2) and the
    per-expert GEMMs take their sizes from the host; stage 2 and up wait for nothing."""
    return kind == "moe" and not training.moe_pad_expert_input_to_capacity and not training.moe_syncs_free


def host_priced(hardware: HardwareSpec, training: TrainingSpec, kind: str) -> bool:
    """Whether the hardware file prices the host's work of a layer of ``kind``: ``host_op_seconds`` for every
    layer, ``moe_sync_host_op_seconds`` for a layer that waits for token counts."""
    return hardware.host_op_seconds is not None or (
        hardware.moe_sync_host_op_seconds is not None and waits_for_token_counts(training, kind))


def _regions(model: ModelSpec, training: TrainingSpec, kind: str, fp8: bool) -> tuple[dict[str, tuple[float, float]], float]:
    """The framework work of one layer of ``kind`` by region -- (linear modules, other ops) -- and the kernels a
    grouped GEMM's per-expert loop launches per grouped linear (0 for a dense layer)."""
    t = training
    regions: dict[str, tuple[float, float]] = {}
    regions["attn"] = (2, OPS["attn"] + (OPS["qk_norm"] if model.qk_layernorm else 0))
    if kind == "dense":
        regions["mlp"] = (2, OPS["mlp"])
        return regions, 0.0
    ops = moe_op_counts(t)
    local = model.num_experts // t.ep
    shared = 2 if model.moe_shared_expert_intermediate_size else 0
    regions["moe_router"] = (0, ops["moe_norm"] + ops["moe_gating"] + ops["moe_score_topk"] + ops["moe_aux_loss"])
    regions["moe_preprocess"] = (0, ops["moe_preprocess"] + (ops["moe_dtoh"] if waits_for_token_counts(t, kind) else 0))
    bias = OPS["expert_bias"] + local * OPS["expert_bias_each"] if model.add_bias_linear else 0  # TEGroupedMLP._apply_bias
    padding = OPS["moe_fp8_padding"] if fp8 and RankShape(model, t).fp8_padding_copies else 0
    regions["moe"] = (2 + shared, ops["moe_permute"] + ops["moe_dispatch"] + (2 * ops["moe_sort"] if local > 1 else 0)
                      + ops["moe_experts"] + padding + ops["moe_unpermute"] + ops["moe_combine"]
                      + (OPS["shared_expert"] if shared else 0) + bias)
    # each expert's GEMM (and its input's cast) per grouped linear; Primus-Turbo's grouped GEMM runs all local
    # experts in one launch (examples/moe_package/README.md, "Turbo Grouped GEMM")
    gemms = 1 if t.use_turbo_grouped_gemm else local
    return regions, gemms * (1 + (1 if fp8 and t.experts_fp8 else 0))  # the legacy GroupedMLP casts nothing


MOE_REGIONS = ("moe_router", "moe_preprocess", "moe")
"""The regions of an MoE layer whose kernels work on a share of the microbatch (routing metadata, one expert's
tokens) rather than on all of it."""


def moe_small_kernels(model: ModelSpec, training: TrainingSpec, fp8: bool | None = None) -> tuple[float, float, float]:
    """Kernels of one MoE layer's routing, dispatch and experts on one rank per microbatch, forward, input
    gradient and weight gradient -- what the device runs whether CUDA graphs replay them or the host issues
    them one by one (graphs remove the host's cost and shorten the gap between kernels, not the kernels).
    Counted in the host's units (a Transformer Engine linear as its ops, a grouped GEMM's per-expert GEMMs
    and casts one each): a structural estimate, as :data:`OPS` is."""
    return _small_kernels(model, training, fp8, lambda region: True)


def moe_stream_kernels(model: ModelSpec, training: TrainingSpec, fp8: bool | None = None) -> tuple[float, float, float]:
    """The :func:`moe_small_kernels` the host launches into a stream one by one (F, B, W): those of the regions
    CUDA graphs do not capture, each of which pays the device's stream launch gap that a graph node does not."""
    return _small_kernels(model, training, fp8, lambda region: not training.captures(region))


def _small_kernels(model: ModelSpec, training: TrainingSpec, fp8: bool | None, counted: Callable[[str], bool]
                   ) -> tuple[float, float, float]:
    """The small kernels of the MoE regions ``counted`` keeps, per pass (the grouped GEMMs' in ``moe``)."""
    fp8 = training.fp8 if fp8 is None else fp8
    linear = TE_LINEAR_OPS[fp8]
    regions, per_expert = _regions(model, training, "moe", fp8)
    moe = [regions[r] for r in MOE_REGIONS if counted(r)]
    launches = per_expert * 2 if counted("moe") else 0.0  # two grouped linears
    both = sum(linears * linear + ops for linears, ops in moe) + launches
    return both, both, sum(linears * linear for linears, _ in moe) + launches


def layer_host(model: ModelSpec, training: TrainingSpec, kind: str, fp8: bool | None = None) -> LayerHost:
    """Host work of one layer of ``kind`` (``dense`` or ``moe``) on one rank, per microbatch."""
    t = training
    fp8 = t.fp8 if fp8 is None else fp8
    linear = TE_LINEAR_OPS[fp8]
    regions, per_expert = _regions(model, t, kind, fp8)
    assert not (kind == "moe" and t.captures("moe") and not t.moe_pad_expert_input_to_capacity), \
        "check_compatible refuses capturing an MoE layer not padded to capacity"
    forward = backward_input = backward_weight = 0.0
    launches = 0.0 if kind == "dense" or t.captures("moe") else per_expert * 2  # two grouped linears
    for region, (linears, ops) in regions.items():
        if t.captures(region):
            forward, backward_input = forward + 1, backward_input + 1  # one graph replay each way
            continue
        forward += linears * linear + ops
        backward_input += linears * linear + ops
        backward_weight += linears * linear
    syncs = waits_for_token_counts(t, kind)
    return LayerHost(HostWork(forward, launches), HostWork(backward_input, launches), HostWork(backward_weight, launches),
                     syncs)


def host_bound(device: tuple[float, float, float], host: tuple[float, float, float], syncs: bool
               ) -> tuple[float, float, float]:
    """A layer's F, B, W seconds once the host is counted: a pass after a sync point takes max(host, device)
    alone; passes the host may run ahead over are stretched together by what the host takes over them all."""
    def stretched(d: tuple[float, ...], h: tuple[float, ...]) -> tuple[float, ...]:
        total = sum(d)
        if total <= 0:
            return tuple(max(x, y) for x, y in zip(d, h))
        factor = max(1.0, sum(h) / total)
        return tuple(x * factor for x in d)

    if syncs:
        return (max(device[0], host[0]), *stretched(device[1:], host[1:]))
    return stretched(device, host)  # type: ignore[return-value]
