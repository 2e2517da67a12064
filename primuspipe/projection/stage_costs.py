"""Per-stage costs for the simulator: the model's parts summed over each stage's layers.

For one (model, training, cluster, placement) this adds up, per pipeline stage: the F / B / W seconds
of its layers (compute, plus the TP / CP / EP collectives they wait on, plus recompute's repeated
forward in B), the embedding on stage 0 and the head on the last stage; the activation bytes one
microbatch leaves on the stage; and per rank the static bytes (weights, gradients, optimizer state).
What a deferred W keeps after B (GEMM inputs and output gradients) becomes the simulator's
``w_retained_fraction``: one share for the whole pipeline, the byte-weighted mean over stages, capped
at 1; what W keeps beyond the stage's bytes (sequence parallelism's all-gathered output gradients, full recompute)
becomes ``w_excess_fraction`` (the byte-weighted mean of the excess), which the byte peaks hold until W. What
a split-backward B keeps for W before it frees becomes ``b_rise_fraction``: how far B peaks above its start
(:meth:`~primuspipe.projection.activations.ActivationModel.b_rise`), the largest share over stages (never under).
Under ``defer_embedding_wgrad_compute`` the head's weight gradient leaves the last stage's W (and its GEMM
inputs what that W keeps): :attr:`StageCosts.drain_s` and :attr:`StageCosts.drain_bytes` say what the head
rank runs and buffers instead, per microbatch, for the projection to pay once after that rank's last node for
each deferred microbatch. Under a ``wgrad_deferral_limit`` below the microbatch count the later microbatches run
the head's GEMM in their own last-stage W after all: :attr:`StageCosts.late_from` says from which, and the cost
model prices those nodes so (:class:`~primuspipe.ir.cost_parts.LateWork`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from primuspipe.projection.activations import ActivationModel
from primuspipe.projection.comm import layer_comm, p2p_message_bytes, pipeline_ranks_per_node
from primuspipe.projection.compute import PartTimes, layer_part
from primuspipe.projection.framework import (ComputeCosts, CostModel, LateWork, Link, MemoryCost, P2PCost, Placement,
                                             negligible)
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.host import host_bound
from primuspipe.projection.layout import StageLayout
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.parameters import ParamCount, layers_params, rank_params
from primuspipe.projection.static_memory import StaticMemory, static_memory
from primuspipe.projection.training_spec import TrainingSpec


@dataclass(frozen=True)
class StageCosts:
    """What one pipeline layout costs, per stage (times, activations) and per rank (static memory)."""

    layout: StageLayout
    forward: tuple[float, ...]
    """Seconds per stage and microbatch (so are the next two)."""
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    """Bytes one microbatch leaves saved on each stage."""
    w_retained_fraction: float
    w_excess_fraction: float
    b_rise_fraction: float
    """The share of a stage's microbatch activations by which its split-backward B peaks above its start
    (the largest over stages); fused backward (BW) nodes never rise."""
    params: tuple[ParamCount, ...]
    """Per rank."""
    static: tuple[StaticMemory, ...]
    """Per rank."""
    transient_bytes: tuple[float, ...]
    """Per rank: what a full-recompute backward rebuilds at once, the unfused loss's fp32 copy beside the
    logits (the last stage) or the local attention's working set, whichever is larger, plus the local attention's
    score buffer, on top of what the schedule holds (reported as the recompute working set)."""
    p2p: P2PCost
    communication: tuple[float, float, float]
    """Seconds of TP / CP / EP collectives inside F, B and W that compute does not hide, summed over stages
    (part of the times above)."""
    drain_s: float = 0.0
    """Seconds per microbatch of the head's weight-gradient GEMM that ``defer_embedding_wgrad_compute`` takes
    out of the last stage's W and runs after the head rank's last backward; 0 without it."""
    drain_bytes: float = 0.0
    """Bytes per microbatch the head rank buffers for that drain (output-layer input and output gradient)."""
    late_from: int = 0
    """Under a partial deferral (``wgrad_deferral_limit`` below the microbatch count), the first microbatch whose
    last-stage W runs the head's GEMM (``drain_s``) after all; 0: none does."""

    def cost_model(self) -> CostModel:
        """The simulator's cost model, in seconds. A link's latency or transfer more than
        :data:`~primuspipe.ir.cost_model.MAX_TIME_RATIO` times shorter than the longest time is none
        (:func:`~primuspipe.ir.cost_model.negligible`), as is such a compute time: figures each within their
        span (a 1 GFLOP/s host beside a 5 us link) gave times the cost model refuses as too far apart, which
        refused every candidate in turn instead of projecting them."""
        p2p = self.p2p
        links = (p2p.intra_node, p2p.inter_node)
        longest = max(*self.forward, *self.backward_input, *self.backward_weight,
                      *(link.time(p2p.message_bytes) for link in links))

        def kept(link: Link) -> Link:
            moving = negligible(p2p.message_bytes / link.bandwidth, longest)
            return Link(negligible(link.latency, longest), link.bandwidth if moving else math.inf)

        def times(values: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(negligible(t, longest) for t in values)

        memory = MemoryCost(w_retained_fraction=self.w_retained_fraction, w_excess_fraction=self.w_excess_fraction,
                            b_rise_fraction=self.b_rise_fraction,
                            activation_bytes=self.activation_bytes,
                            parameter_bytes=tuple(s.weights for s in self.static),
                            gradient_bytes=tuple(s.gradients_beside_activations for s in self.static),
                            optimizer_bytes=tuple(s.optimizer for s in self.static))
        return CostModel(ComputeCosts(times(self.forward), times(self.backward_input), times(self.backward_weight)),
                         p2p=dataclasses.replace(p2p, intra_node=kept(links[0]), inter_node=kept(links[1])),
                         memory=memory, time_unit="s",
                         late_w=LateWork(len(self.forward) - 1, self.late_from, negligible(self.drain_s, longest))
                         if self.late_from else None)


def stage_costs(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, parts: dict[str, PartTimes],
                placement: Placement) -> StageCosts:
    """Costs of ``placement`` (pp ranks x vpp chunks) with per-part times ``parts``."""
    layout = StageLayout.build(model.num_layers, training, placement)
    activations = ActivationModel(model, training)
    bf16 = training.bf16_layers(model.num_layers)
    names = {layer_part(kind, b): (kind, b) for kind in set(model.layer_kinds) for b in (False, True)
             if layer_part(kind, b) in parts}
    exposed = {name: layer_comm(model, training.without_fp8() if b else training, hardware, kind).exposed(
                   training, parts[name].gemm, parts[name].attention,
                   (parts[name].forward, parts[name].backward_input, parts[name].backward_weight))
               for name, (kind, b) in names.items()}
    last = layout.num_stages - 1
    defer = training.defer_embedding_wgrad_compute
    late_from = training.deferred_microbatches if 0 < training.deferred_microbatches < training.microbatches else 0
    forward, backward_input, backward_weight, held, kept_for_w, excess, rise, transient = [], [], [], [], [], [], [], []
    communication = [0.0, 0.0, 0.0]
    for stage, layers in enumerate(layout.stage_layers):
        kinds = [layer_part(model.layer_kinds[i], i in bf16) for i in layers]
        extras = [parts[p] for p, here in (("embedding", stage == 0), ("head", stage == last)) if here]
        if stage == last and training.mtp_num_layers:
            extras += [parts["mtp"]] * training.mtp_num_layers
        again = activations.recomputed(layers)
        waits = [0.0, 0.0, 0.0]
        mtp = [model.layer_kinds[-1]] * (training.mtp_num_layers or 0) if stage == last else []
        for k, full in zip(kinds + mtp, again + [False] * len(mtp)):  # an MTP module's layer talks as a layer
            f_wait, b_wait, w_wait = exposed[k]
            for i, wait in enumerate((f_wait, b_wait + (f_wait if full else 0.0), w_wait)):
                waits[i] += wait
        communication = [c + w for c, w in zip(communication, waits)]
        f = b = w = 0.0
        for k, full in zip(kinds, again):
            p, (f_wait, b_wait, w_wait) = parts[k], exposed[k]
            device = (p.forward + f_wait, p.backward_input + (p.forward + f_wait if full else p.recompute) + b_wait,
                      p.backward_weight + w_wait)
            host = (p.host[0], p.host[1] + (p.host[0] if full else 0.0), p.host[2])
            lf, lb, lw = host_bound(device, host, p.host_syncs)
            f, b, w = f + lf, b + lb, w + lw
        for k in mtp:
            f_wait, b_wait, w_wait = exposed[k]
            f, b, w = f + f_wait, b + b_wait, w + w_wait
        forward.append(f + sum(x.forward for x in extras))
        backward_input.append(b + sum(x.backward_input for x in extras))
        backward_weight.append(w + sum(x.backward_weight for x in extras)
                               - (parts["head"].backward_weight if defer and stage == last else 0.0))
        # A layer's moments come while its microbatch's head (and MTP modules) are not yet made (forward) or
        # already freed (backward), though the stage's held bytes count them for that microbatch throughout.
        mtp = activations.mtp() * (training.mtp_num_layers or 0) if stage == last else 0.0
        head = activations.head_tensors() + mtp if stage == last else 0.0
        stage_bytes = (sum(activations.layer_bytes(layers)) + (activations.embedding() if stage == 0 else 0.0)
                       + (activations.head() + mtp if stage == last else 0.0))
        held.append(stage_bytes)
        # a microbatch past a partial deferral's limit keeps its head GEMM's inputs for its own W
        w_bytes = activations.wgrad_bytes(layers) + (activations.head_gemm_bytes()
                                                     if stage == last and (late_from or not defer) else 0.0)
        kept_for_w.append(min(stage_bytes, w_bytes))
        excess.append(w_bytes - kept_for_w[-1])
        in_layers = max(activations.recompute_working_set(layers),
                        activations.attention_working_set() if layers else 0.0)
        loss = activations.loss_working_set() if stage == last else 0.0
        moment = max(in_layers - head, loss, 0.0)  # at different moments: the larger shows
        freed = max(in_layers, loss, 0.0) - moment  # the head a layer's moment no longer holds
        transient.append(moment + activations.attention_buffer())
        rise.append(activations.b_rise(layers, head=stage == last, freed_in_layers=freed) / stage_bytes
                    if stage_bytes else 0.0)
    params = rank_params(model, training, layout)
    ranks = range(placement.pp)
    return StageCosts(
        layout, tuple(forward), tuple(backward_input), tuple(backward_weight), tuple(held),
        sum(kept_for_w) / sum(held), sum(excess) / sum(held), max(rise), tuple(params),
        tuple(static_memory(p, training, len(layers), p.total - layers_params(model, training, layers).total)
              for p, layers in zip(params, ([i for s in layout.rank_stages(r) for i in layout.stage_layers[s]]
                                            for r in ranks))),
        tuple(max(transient[s] for s in layout.rank_stages(r)) for r in ranks),
        _p2p(model, training, hardware), tuple(communication),
        parts["head"].backward_weight if defer else 0.0, activations.head_gemm_bytes() if defer else 0.0, late_from,
    )


def _p2p(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec) -> P2PCost:
    efficiency = hardware.network_efficiency
    return P2PCost(
        message_bytes=p2p_message_bytes(model, training),
        intra_node=Link(hardware.intra_node_latency_s, hardware.peer_bandwidth * efficiency),
        inter_node=Link(hardware.inter_node_latency_s, hardware.inter_node_bandwidth_bytes_per_s * efficiency),
        ranks_per_node=pipeline_ranks_per_node(training, hardware),
    )
