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

What each layer issues is counted from megatron-core 0.19's code path (:data:`OPS`), and what multi-latent
attention and group-limited routing add to it op by op (:data:`FEATURES`). The counts are a
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
    "expert_input_bias": 2,   # AutoModel's first bias (expert_kernels: automodel-deepep): split, concatenate
    "expert_input_bias_each": 1,  # ... and per local expert: the bias added to the expert's slice
}
"""Framework ops of one layer's forward besides its linear modules, by region; each has one autograd node
backward (in B). A fused kernel replaces a group by one op (:func:`moe_op_counts`)."""


@dataclass(frozen=True)
class Feature:
    """What a model feature adds to a region of the standard layer :data:`OPS` counts: linear modules (each
    priced as :data:`TE_LINEAR_OPS` forward, B and W) and other kernel-launching ops, forward and in B, counted
    from megatron-core's code (the TE layer spec, ``gpt_layer_specs.py``). Views, splits and ``IdentityOp``s
    launch nothing forward and are not counted, as in :data:`OPS`; the kernels their autograd nodes launch in B
    are. Unlike :data:`OPS`, B is counted apart: an op whose output carries no gradient has no node there."""

    region: str
    on: Callable[[ModelSpec, TrainingSpec], bool]
    linears: float = 0.0
    forward: float = 0.0
    backward: float = 0.0


def _group_limited(model: ModelSpec, training: TrainingSpec) -> bool:
    """Megatron's ``group_limited_topk`` runs: groups set and the top-k not fused (a fused router takes the
    groups inside its one op)."""
    fused = training.moe_router_fusion or training.moe_use_fused_router_with_aux_score
    return bool(model.moe_router_group_topk) and not fused


FEATURES = {
    # MLASelfAttention (megatron/core/transformer/multi_latent_attention.py, Megatron-LM 84778176 as Primus pinned
    # it for the DeepSeek-V2 rows; core_v0.19.0 runs the same unless mla_down_proj_fusion): the input norm is a
    # TENorm of its own (the standard layer fuses it into linear_qkv); the kv down- and up-projections beside
    # the query projection; the latent norms are fused into the up-projections (q_layernorm / kv_layernorm are
    # IdentityOp; :func:`_regions` counts no per-head qk norms for MLA)
    "mla": Feature("attn", lambda m, t: m.multi_latent_attention, linears=2, forward=1, backward=1),
    # a query latent (q_lora_rank): linear_q_down_proj and linear_q_up_proj instead of linear_q_proj
    "mla_query_latent": Feature("attn", lambda m, t: m.multi_latent_attention and bool(m.q_lora_rank), linears=1),
    # without apply_rope_fusion (qkv_up_proj_and_rope_apply's unfused branch): forward, the interleaving torch.cat
    # in each of the two _apply_rotary_pos_emb_bshd calls (multi_latent_attention at 84778176, mla_rotary_interleaved
    # =True at core_v0.19.0; MLA's unfused path interleaves whatever the rotary settings), torch.cat of the query and of
    # the key, value.contiguous(); in B, each interleave's two slice_backward kernels and their sum, the broadcast
    # rotary key's expand summed over heads, the query's and kv's splits joined back (the fused kernels take q
    # and kv whole)
    "mla_unfused_rope": Feature("attn", lambda m, t: m.multi_latent_attention and not t.apply_rope_fusion,
                                forward=2 + 2 + 1, backward=2 * 3 + 1 + 2),
    # sequence parallel: the rotary key, cut from the replicated kv down-projection's output on the shard, is
    # gathered (gather_from_sequence_parallel_region; reduce-scattered in B)
    "mla_sequence_parallel": Feature("attn", lambda m, t: m.multi_latent_attention and t.sp, forward=1, backward=1),
    # group_limited_topk (megatron/core/transformer/moe/moe_utils.py, the same at 84778176 and core_v0.19.0) in
    # place of one torch.topk: the per-group topk, its sum, the group topk, zeros_like, scatter_, the expanded
    # mask's reshape (a copy), .bool(), ~, masked_fill, then the same final topk; in B only masked_fill's node
    # (the group picks are indices; with a sigmoid's expert bias not even that: not a field here, counted as 1)
    "group_limited_routing": Feature("moe_router", _group_limited, forward=9, backward=1),
}
"""The host work of model features beyond :data:`OPS`'s standard layer, keyed on the fields that turn them on."""


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


Region = tuple[float, float, float]
"""A region's linear modules, its other ops forward and its other ops in B."""


def _regions(model: ModelSpec, training: TrainingSpec, kind: str, fp8: bool) -> tuple[dict[str, Region], float]:
    """The framework work of one layer of ``kind`` by region and the kernels a grouped GEMM's per-expert loop
    launches per grouped linear (0 for a dense layer); :data:`FEATURES` added to their regions."""
    regions, per_expert = _standard_regions(model, training, kind, fp8)
    for feature in FEATURES.values():
        if feature.region in regions and feature.on(model, training):
            linears, forward, backward = regions[feature.region]
            regions[feature.region] = (linears + feature.linears, forward + feature.forward, backward + feature.backward)
    return regions, per_expert


def _standard_regions(model: ModelSpec, training: TrainingSpec, kind: str, fp8: bool
                      ) -> tuple[dict[str, Region], float]:
    """:func:`_regions` before :data:`FEATURES`, each op with one node in B."""
    t = training
    regions: dict[str, Region] = {}
    qk_norm = OPS["qk_norm"] if model.qk_layernorm and not model.multi_latent_attention else 0
    regions["attn"] = (2, OPS["attn"] + qk_norm, OPS["attn"] + qk_norm)
    if kind == "dense":
        regions["mlp"] = (2, OPS["mlp"], OPS["mlp"])
        return regions, 0.0
    ops = moe_op_counts(t)
    local = model.num_experts // t.ep
    shared = 2 if model.moe_shared_expert_intermediate_size else 0
    router = ops["moe_norm"] + ops["moe_gating"] + ops["moe_score_topk"] + ops["moe_aux_loss"]
    regions["moe_router"] = (0, router, router)
    preprocess = ops["moe_preprocess"] + (ops["moe_dtoh"] if waits_for_token_counts(t, kind) else 0)
    regions["moe_preprocess"] = (0, preprocess, preprocess)
    bias = OPS["expert_bias"] + local * OPS["expert_bias_each"] if model.add_bias_linear else 0  # TEGroupedMLP._apply_bias
    if model.add_bias_linear and t.expert_kernels == "automodel-deepep":
        bias += OPS["expert_input_bias"] + local * OPS["expert_input_bias_each"]
    padding = OPS["moe_fp8_padding"] if fp8 and RankShape(model, t).fp8_padding_copies else 0
    moe = (ops["moe_permute"] + ops["moe_dispatch"] + (2 * ops["moe_sort"] if local > 1 else 0) + ops["moe_experts"]
           + padding + ops["moe_unpermute"] + ops["moe_combine"] + (OPS["shared_expert"] if shared else 0) + bias)
    regions["moe"] = (2 + shared, moe, moe)
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
    return (sum(linears * linear + forward for linears, forward, _ in moe) + launches,
            sum(linears * linear + backward for linears, _, backward in moe) + launches,
            sum(linears * linear for linears, _, _ in moe) + launches)


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
    for region, (linears, ops, backward_ops) in regions.items():
        if t.captures(region):
            forward, backward_input = forward + 1, backward_input + 1  # one graph replay each way
            continue
        forward += linears * linear + ops
        backward_input += linears * linear + backward_ops
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
