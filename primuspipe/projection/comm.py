"""Communication time: the collectives each parallelism adds, and the pipeline's point-to-point link.

Collectives follow the ring (bandwidth-optimal) cost model of Thakur et al. 2005 ("Optimization of
Collective Communication Operations in MPICH") over ``n`` ranks moving a buffer of ``S`` bytes:
all-reduce ``2 (n-1)/n * S / bw + 2 (n-1) * latency``; all-gather, reduce-scatter and all-to-all
``(n-1)/n * S / bw + (n-1) * latency``. The bandwidth is the intra-node fabric's when the group fits in
one node (on a fully connected mesh, the links among the group's members only:
:meth:`HardwareSpec.group_fabric_bandwidth`; a ring's shift to the next rank, one link), else the
network cards' of the group's members on one node (NCCL runs a ring per card, each
crossing between nodes on its own card: a group with ``m`` members a node has ``m`` cards' bandwidth, up to
the node's fabric; a strided group with one member a node has one card's), times ``network_efficiency``.

Ranks are ordered as Megatron orders them (tensor, context, data, pipeline, innermost first; experts:
expert-tensor, expert, data), so a group spans a run of consecutive ranks: TP ``tp``, CP ``tp * cp``,
EP ``etp * ep``, data parallel ``tp * cp * dp`` ranks.

Where the collectives fall (Narayanan et al. 2021; Korthikanti et al. 2022; none overlapped with
compute, except the data-parallel gradient reduction when ``overlap_grad_reduce``):

* TP: per layer two all-reduces of a ``T H`` activation in F and two in B (with sequence parallelism,
  an all-gather and a reduce-scatter each, the same time); with sequence parallelism W all-gathers the
  two sharded GEMM inputs again;
* CP: per layer the ring's ``CP - 1`` passes of a K and V block to the next rank in F (an all-gather's
  volume), and as many again plus those of their gradients in B;
* EP: per MoE layer an all-to-all to dispatch the ``T_r k`` token copies and one to combine them, in
  F and again in B;
* DP, once per step after the last backward: with the distributed optimizer a reduce-scatter of the
  main gradients (fp32 unless narrowed) and an all-gather of the updated bf16 weights, else an all-reduce of the gradients;
  expert parameters over the expert-data-parallel group; tied embeddings add an all-reduce of the
  embedding gradient between the first and last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.parameters import DenseBuffer, ParamCount
from primuspipe.projection.routing import destinations
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import RankShape, TrainingSpec


@dataclass(frozen=True)
class Collectives:
    """Collective timings for groups of a given span on one cluster."""

    hardware: HardwareSpec

    def _link(self, ranks: int, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a ring over ``ranks`` spread evenly over ``span`` consecutive ranks.

        Across nodes NCCL runs one ring (channel) per network card, each crossing between nodes on its own
        card, so a ring's share of a node's traffic leaves through every card of the node's group members:
        with ``m`` members a node, the inter-node links carry ``m`` cards' bandwidth (up to the node's
        fabric); with one member a node (a strided group), one card's. Inside a node the group has the fabric its
        members reach each other by (:meth:`HardwareSpec.group_fabric_bandwidth`). (Across nodes a mesh binds no
        tighter: each of the ``m`` rings crosses one link a hop, at one card's rate, below a link's.)"""
        h = self.hardware
        if span <= h.gpus_per_node:
            return h.group_fabric_bandwidth(ranks) * h.network_efficiency, h.intra_node_latency_s
        members = max(1, ranks * h.gpus_per_node // span)
        cards = min(members * h.inter_node_bandwidth_bytes_per_s, h.intra_node_bandwidth_bytes_per_s)
        return cards * h.network_efficiency, h.inter_node_latency_s

    def compute_share(self, ranks: int, span: int) -> float:
        """Share of a GPU's compute units a ring collective over ``ranks`` spread over ``span`` consecutive ranks
        holds while it runs: across nodes :attr:`HardwareSpec.collective_ctas_per_card` per card the group's
        members on a node use, inside one node the channels :attr:`HardwareSpec.intra_node_collective_channels`
        gives a group of its size; 0 where the hardware file gives no count."""
        h = self.hardware
        if ranks == 1 or not h.compute_units:
            return 0.0
        if span <= h.gpus_per_node:
            sizes = [channels for size, channels in sorted(h.intra_node_collective_channels or ()) if size <= ranks]
            return sizes[-1] / h.compute_units if sizes else 0.0
        if not h.collective_ctas_per_card:
            return 0.0
        return h.collective_ctas_per_card * max(1, ranks * h.gpus_per_node // span) / h.compute_units

    def gather(self, nbytes: float, ranks: int, span: int) -> float:
        """All-gather (or reduce-scatter) of a ``nbytes`` buffer over ``ranks`` (a ring)."""
        if ranks == 1 or nbytes == 0:
            return 0.0
        bandwidth, latency = self._link(ranks, span)
        return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency

    def shift(self, nbytes: float, ranks: int, span: int) -> float:
        """Every rank of the ring sends ``nbytes`` to the next at once (PyTorch's ``permute_tensor``, Transformer
        Engine's ring): inside a node one peer's bandwidth (on a fully connected mesh, one link); across nodes one
        network card's, however many of the ring's members share a node. A ring collective spreads a node's share
        over its members' cards (:meth:`_link`), but a send to a rank on another node is one NCCL point-to-point
        connection, and NCCL puts it on one card: point-to-point connections are set up with no ring graph
        (``ncclTransportP2pSetup(comm, NULL, 1)``, ``src/group.cc``), for which ``ncclTopoGetNetDev`` takes the rank's
        own card, or by PXN the card on the peer's rail (``ncclTopoGetLocalNet``: ``channelId % DIVUP(localNetCount,
        localGpuCount)`` cards a GPU, one where each GPU has its own; NVIDIA/nccl ``src/graph/search.cc`` and
        ``src/graph/topo.cc``, v2.20.3-1 and master alike)."""
        h = self.hardware
        if ranks == 1 or nbytes == 0:
            return 0.0
        if span <= h.gpus_per_node:
            bandwidth, latency = self._link(2, span)
        else:
            bandwidth, latency = h.inter_node_bandwidth_bytes_per_s * h.network_efficiency, h.inter_node_latency_s
        return nbytes / bandwidth + latency

    def all_reduce(self, nbytes: float, ranks: int, span: int) -> float:
        return 2 * self.gather(nbytes, ranks, span)

    def all_to_all(self, nbytes: float, ranks: int, span: int) -> float:
        """All-to-all of ``nbytes`` per rank over ``ranks`` spanning ``span`` consecutive ranks: the share
        for ranks of the same node crosses the node's fabric, the rest the network, both at once."""
        h = self.hardware
        if ranks == 1 or nbytes == 0:
            return 0.0
        if span <= h.gpus_per_node:
            return self.gather(nbytes, ranks, span)
        local = max(1, ranks * h.gpus_per_node // span)  # group members per node
        intra = (local - 1) / ranks * nbytes / (h.group_fabric_bandwidth(local) * h.network_efficiency)
        inter = (ranks - local) / ranks * nbytes / (h.inter_node_bandwidth_bytes_per_s * h.network_efficiency)
        return max(intra, inter) + (ranks - 1) * h.inter_node_latency_s


@dataclass(frozen=True)
class FusedCollective:
    """One TP collective of a layer tied to the GEMMs it runs beside: under PyTorch's async TP
    (``tp_comm_overlap_impl: torch-async-tp``) the matmuls it is fused with, under Transformer Engine's userbuffers
    the one GEMM of its overlap call (:func:`userbuffers_collectives`)."""

    pass_index: int
    """The pass whose time it counts in: 0: F, 1: B, 2: W."""
    seconds: float
    gemm_share: float
    """Share of a pass's GEMM time in the GEMMs it runs beside (by their FLOPs); 0: beside none, it shows whole."""
    scatter: bool = False
    """A reduce-scatter pipelined with its GEMM: its last of ``TP`` steps follows the last GEMM chunk and shows."""
    under: int | None = None
    """The pass whose GEMMs it runs beside, where not its own (Transformer Engine's bulk overlaps in the backward:
    B's reduce-scatters beside W's GEMMs, W's re-gathers beside B's); None: ``pass_index``."""

    def shown(self, gemm: tuple[float, ...], tp: int) -> float:
        """Seconds of it the GEMMs beside it (``gemm``: each pass's GEMM seconds) do not hide."""
        if not self.gemm_share:
            return self.seconds
        beside = self.gemm_share * gemm[self.pass_index if self.under is None else self.under]
        return max(self.seconds / tp if self.scatter else 0.0, self.seconds - beside)


@dataclass(frozen=True)
class LayerComm:
    """Seconds a layer of each kind spends in TP / CP / EP collectives, per pass (F, B, W) and microbatch,
    before any overlap with compute."""

    tp: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cp: tuple[float, float, float] = (0.0, 0.0, 0.0)
    ep: tuple[float, float, float] = (0.0, 0.0, 0.0)
    tp_tail: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of ``tp``, what an overlapped GEMM cannot hide: the last of the ``TP`` steps of each reduce-scatter, which
    follows the last GEMM chunk (the all-gathers start on the rank's own chunk)."""
    blocking: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Small collectives the next kernel waits on and no overlap hides: under current scaling with sequence
    parallelism, the amax all-reduce over TP before each gathered operand is quantized."""
    dispatcher_share: float = 0.0
    """Share of the compute units the flex dispatcher's kernels hold while they run (``TrainingSpec.dispatcher_sms``
    over the hardware's ``compute_units``)."""
    fused: tuple[FusedCollective, ...] = ()
    """Under PyTorch's async TP: the TP collectives of F and B one by one (:func:`async_tp_collectives`)."""
    partial_sums: float = 0.0
    """Under PyTorch's async TP: F's seconds in the kernels that sum the fused reduce-scatters' partials."""
    cp_steps: tuple[tuple[tuple[float, int], ...], ...] = ()
    """Under PyTorch's context parallelism (``cp_implementation`` torch-*), F's and B's CP transfers as
    ``(seconds, attention steps they run under)``, transfers in flight at once summed (:func:`torch_cp_steps`)."""

    @property
    def forward(self) -> float:
        return self.tp[0] + self.cp[0] + self.ep[0] + self.blocking[0]

    @property
    def backward_input(self) -> float:
        return self.tp[1] + self.cp[1] + self.ep[1] + self.blocking[1]

    @property
    def backward_weight(self) -> float:
        return self.tp[2] + self.cp[2] + self.ep[2] + self.blocking[2]

    def exposed(self, training: TrainingSpec, gemm: tuple[float, ...], attention: tuple[float, ...],
                compute: tuple[float, ...]) -> tuple[float, float, float]:
        """Seconds of each pass the compute does not hide, as the frameworks overlap:

        * TP with ``tp_comm_overlap`` (Transformer Engine's userbuffers, as Megatron-Bridge configures them for
          each GEMM): the all-gathers feed the GEMM chunk by chunk in a ring, starting on the rank's own chunk
          (QKV and the MLP's first linear forward, the output gradients of the projection and the second
          linear); each reduce-scatter runs behind the GEMM chunk that produced its data, so its last step
          shows (``tp_tail``); the re-gathers of W and the reduce-scatters of B run beside the other backward
          GEMM (bulk overlap). Each overlap is one call around one GEMM, which the next kernel waits on whole
          (``fused``: :func:`userbuffers_collectives`), so in a dense layer with sequence parallelism a collective
          hides under its own GEMM only; elsewhere (MoE and MLA layers) under the pass's GEMMs pooled. What
          outlasts the GEMMs shows in any case;
        * TP with ``tp_comm_overlap`` and ``tp_comm_overlap_impl: torch-async-tp`` (PyTorch's async TP, inductor's
          ``micro_pipeline_tp`` pass): an all-gather is fused only into the matmuls that take its output as their
          left operand (``fuse_all_gather_matmul``), a reduce-scatter only into the one matmul whose output it
          scatters (``_find_producer_matmul``), each pipelined over ``TP`` steps; so each fused collective hides
          under its own matmuls only (``fused``: QKV's and the MLP's first linear's input gathers, the projection's
          and second linear's reduce-scatters, whose last step shows; in B the gathers of those two linears'
          output gradients under their input-gradient GEMMs). B's reduce-scatters of the input gradients of QKV and
          of the first linear scatter a sum of GEMM outputs (the gradients of the inputs the linears share), which
          the pass does not match: they run unfused and show whole. A fused reduce-scatter sums its ``TP``
          partials in a kernel of its own (``_fused_matmul_reduce_scatter_impl``'s ``reduce_fn``), which shows
          (``partial_sums``); the fused matmuls run split into ``TP`` steps
          (:meth:`~primuspipe.projection.compute.WorkModel._async_tp_split`). W as under Transformer Engine;
        * CP (``cp_implementation: te-p2p``): ring attention passes key/value blocks under the attention of the
          block before; the first of ``CP`` steps, or what outlasts the attention, shows. Under PyTorch's
          (``torch-allgather`` / ``torch-alltoall``) each transfer hides under the attention steps it runs beside
          (``cp_steps``; the ``CP`` steps do equal work), what outlasts them shows;
        * EP with ``overlap_moe_expert_parallel_comm``: one microbatch's all-to-alls under another's compute
          of the same pass; what outlasts it shows. The flex dispatcher's kernels hold SMs while they run
          (``dispatcher_share``; DeepEP is built to keep the rest for compute, DeepSeek-V3 report 3.2.2), so the
          compute they overlap runs on the remaining ``1 - share`` and takes ``1 / (1 - share)`` as long: its
          extra time shows too. Otherwise all of it;
        * ``blocking`` collectives: all of them.
        """
        t = training
        exposed = []
        for i in range(3):
            tp = (max(self.tp_tail[i], self.tp[i] - gemm[i]) if t.tp_comm_overlap and t.tp > 1 else self.tp[i])
            if t.tp_comm_overlap and t.tp > 1 and any(c.pass_index == i for c in self.fused):
                tp = (i == 0) * self.partial_sums + sum(c.shown(gemm, t.tp) for c in self.fused if c.pass_index == i)
            if self.cp_steps and i < 2:
                cp = sum(max(0.0, seconds - steps * attention[i] / t.cp) for seconds, steps in self.cp_steps[i])
            else:
                cp = max(self.cp[i] / t.cp, self.cp[i] - attention[i]) if t.cp > 1 else self.cp[i]
            beside = min(self.ep[i], compute[i])  # the compute the overlapped all-to-alls run beside
            ep = (self.ep[i] - beside + beside * self.dispatcher_share / (1 - self.dispatcher_share)
                  if t.overlap_moe_expert_parallel_comm else self.ep[i])
            exposed.append(tp + cp + ep + self.blocking[i])
        return exposed[0], exposed[1], exposed[2]


def layer_comm(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, kind: str) -> LayerComm:
    t, net, shape = training, Collectives(hardware), RankShape(model, training)
    e, tokens = shape.e, shape.tokens
    activation = tokens * model.hidden_size * e  # the full (gathered) T x H tensor
    tp = net.all_reduce(activation, t.tp, t.tp) * 2  # two per layer: after attention and after the MLP
    # Under per-tensor FP8 with sequence parallelism, Transformer Engine gathers the quantized shards: the inputs of
    # QKV and of a dense MLP's first linear in F and W, the output gradients of the projection and of a dense MLP's
    # second linear in B, one byte per element (see WorkModel._quantize_bytes); the reduce-scatters stay bf16.
    # Current scaling needs the amax of the whole gathered operand: an all-reduce of one value over TP before each
    # of those quantizations (TE's input / grad-output quantizers with_amax_reduction over the TP group).
    fp8_gathers = (2 if kind == "dense" else 1) if t.sp and t.per_tensor_fp8 else 0
    narrowed = fp8_gathers * (net.gather(activation, t.tp, t.tp) - net.gather(activation / e, t.tp, t.tp))
    tp -= narrowed
    amax = fp8_gathers * net.all_reduce(4, t.tp, t.tp) if t.fp8_recipe == "tensorwise" else 0.0
    head_dim = model.qk_head_dim + model.qk_pos_emb_head_dim if model.multi_latent_attention else model.head_dim
    kv_heads = model.num_attention_heads if model.multi_latent_attention else model.query_groups
    kv = tokens * t.cp * 2 * kv_heads / t.tp * head_dim * e
    # Transformer Engine's ring passes each step's KV block to the next rank only: CP - 1 shifts (on a switch the
    # same time as an all-gather of the whole; on a fully connected mesh one link each)
    cp = (t.cp - 1) * net.shift(kv / t.cp, t.cp, t.tp * t.cp)
    steps = torch_cp_steps(model, t, net, kv, e) if t.cp_implementation != "te-p2p" else ()
    ep = 0.0
    if kind == "moe":
        routed = copies = shape.residual_tokens * model.moe_router_topk * shape.load_imbalance
        nodes = max(1, t.etp * t.ep // hardware.gpus_per_node)
        if t.moe_token_dispatcher_type == "flex" and nodes > 1:
            # DeepEP sends a token once to every node holding one of its experts and fans it out over NVLink
            # there (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", 3.2.2).
            copies *= token_destinations(model, t, model.num_experts // nodes) / model.moe_router_topk
        elif t.moe_token_dispatcher_type == "flex":
            copies *= destination_ranks(model, t) / model.moe_router_topk
        rows = copies * model.hidden_size * e
        if hybridep_timed(t, hardware, nodes):  # a measured call, its own rows counted (see HardwareSpec)
            ep = 2 * hybridep_seconds(rows, t.ep, hardware)
        else:
            ep = 2 * max(net.all_to_all(rows, t.ep, t.etp * t.ep), deepep_sm_bound(t, hardware, nodes, rows))
            if t.hybridep:  # its permuting copy out of the receive buffer (WorkModel.permutations), each way,
                # counted as a read and a write of every copy (it reads a rank's row once for its local experts)
                ep += 2 * 2 * routed * model.hidden_size * e / (hardware.hbm_bandwidth_bytes_per_s
                                                                   * hardware.memory_bandwidth_fraction)
    # W all-gathers the inputs of QKV and of the first linear again (megatron-core saves their shards); torchtitan's
    # DTensor linears saved them gathered, unless a recompute of the norms gathers them again (TrainingSpec.model_implementation)
    regather = 2 * net.gather(activation, t.tp, t.tp) - narrowed if t.sp and not t.keeps_gathered_inputs else 0.0
    tail = 2 * net.gather(activation, t.tp, t.tp) / t.tp  # the last step of the pass's two reduce-scatters
    beside = kind == "moe" and t.overlap_moe_expert_parallel_comm and hardware.compute_units
    share = t.dispatcher_sms / hardware.compute_units if beside else 0.0  # what the overlapped compute lacks
    assert share < 1, "hardware_spec.check_runs_on refuses a dispatcher holding every SM"
    fused, sums = (), 0.0
    fp8_gather = net.gather(activation / e, t.tp, t.tp) if fp8_gathers else None
    if t.tp_comm_overlap and t.tp_comm_overlap_impl == "torch-async-tp" and t.tp > 1:
        fused = async_tp_collectives(model, t, kind, net.gather(activation, t.tp, t.tp), fp8_gather)
        # each fused reduce-scatter's partial sum reads the TP stacked partials (T x H) and writes the rank's 1/TP
        sums = 2 * activation * (1 + 1 / t.tp) / (hardware.hbm_bandwidth_bytes_per_s * hardware.memory_bandwidth_fraction)
    elif (t.tp_comm_overlap and t.tp > 1 and t.sp and kind == "dense" and not model.multi_latent_attention
          and regather):
        fused = userbuffers_collectives(model, t, net.gather(activation, t.tp, t.tp), fp8_gather)
    cp_passes = (sum(s for s, _ in steps[0]), sum(s for s, _ in steps[1])) if steps else (cp, 2 * cp)
    return LayerComm((tp, tp, regather), (*cp_passes, 0.0), (ep, ep, 0.0), (tail, 0.0, 0.0), (amax, amax, 0.0), share,
                     fused, sums, steps)


def torch_cp_steps(model: ModelSpec, training: TrainingSpec, net: Collectives, kv: float, e: float
                   ) -> tuple[tuple[tuple[float, int], ...], tuple[tuple[float, int], ...]]:
    """F's and B's transfers under PyTorch's experimental ``context_parallel`` (torch
    ``distributed/tensor/experimental/_attention.py``; see ``TrainingSpec.cp_implementation``), each as
    ``(seconds, attention steps it runs under)``, for ``kv`` bytes of the whole sequence's keys and values.

    ``_AllGatherRotater`` all-gathers the rank's K, V (``kv`` gathered) once, launched before step 0's SDPA and
    awaited before step 1's; ``_AllToAllRotater`` sends the rank's current K, V block (``kv / CP``) to the next rank
    before each of the first ``CP - 1`` steps and awaits it before the next. The backward runs the forward's KV
    exchange again, and after each step sends the running dK, dV (fp32: ``convert_to_f32``) to the next rank,
    awaited after the next step's SDPA, the last after the loop: under step ``i`` run the KV transfer launched
    before it and the dK/dV one of step ``i - 1``.

    The ring exchanges the K, V that SDPA is given: torchtitan's Llama (``model_implementation: torchtitan``;
    ``Attention.forward`` at 9dec370 and 820504e) repeats the KV heads to the query heads (``repeat_kv``) before
    ``scaled_dot_product_attention``, so there every query head's K, V travel, not the groups'.

    Traced by ``torch.compile`` (``TrainingSpec.cp_compiled``) each transfer is waited as soon as it is issued:
    it runs under no step."""
    if training.model_implementation == "torchtitan" and not model.multi_latent_attention:
        kv *= model.num_attention_heads / model.query_groups
    cp, span = training.cp, training.tp * training.cp
    if training.cp_implementation == "torch-allgather":
        kv_before = [net.gather(kv, cp, span)] + [0.0] * (cp - 1)
    else:
        kv_before = [net.shift(kv / cp, cp, span)] * (cp - 1) + [0.0]
    dkv = net.shift(kv / cp * 4 / e, cp, span)
    under = 0 if training.cp_compiled else 1
    forward = tuple((s, under) for s in kv_before if s)
    backward = tuple((s + (dkv if i else 0.0), under) for i, s in enumerate(kv_before)) + ((dkv, 0),)
    return forward, backward


def async_tp_collectives(model: ModelSpec, training: TrainingSpec, kind: str, gather: float,
                         fp8_gather: float | None) -> tuple[FusedCollective, ...]:
    """A dense layer's TP collectives under PyTorch's async TP (see :meth:`LayerComm.exposed`), each with the share
    of its pass's GEMM FLOPs in the matmuls fused with it: ``gather`` seconds per all-gather or reduce-scatter,
    ``fp8_gather`` per all-gather of per-tensor FP8 operands (None: they gather ``precision``)."""
    if kind != "dense" or model.multi_latent_attention:
        raise InputError([(training.source, "tp_comm_overlap_impl", training.tp_comm_overlap_impl)],
                         "PyTorch's async TP is modelled for dense layers without multi-latent attention",
                         "use tp_comm_overlap_impl: te-userbuffers for this model")
    share = linear_shares(model, training.tp)
    ag = gather if fp8_gather is None else fp8_gather
    return (*_gathers_into_gemms(share, gather, ag), FusedCollective(1, gather, 0.0), FusedCollective(1, gather, 0.0))


def userbuffers_collectives(model: ModelSpec, training: TrainingSpec, gather: float,
                            fp8_gather: float | None) -> tuple[FusedCollective, ...]:
    """A dense layer's TP collectives under Transformer Engine's userbuffers (``tp_comm_overlap``, sequence
    parallelism), each with the share of a pass's GEMM FLOPs in the one GEMM it runs beside: ``gather`` seconds per
    all-gather or reduce-scatter, ``fp8_gather`` per all-gather of per-tensor FP8 operands (None: ``precision``).

    Every overlap is one call around one GEMM -- ``split_overlap_ag`` / ``split_overlap_rs`` (ring exchange or
    pipeline) and ``bulk_overlap`` in ``common/comm_gemm_overlap/comm_gemm_overlap.cpp`` (TransformerEngine
    bee4649c, NeMo 2.3.0's pin; the same in later releases) -- that ends with the main stream waiting for the
    GEMM's streams and the communication streams (``cudaStreamWaitEvent(stream_main, _stop_send / _stop_recv /
    _stop_comm)``), so what outlasts that GEMM shows before the next kernel: a collective hides under its own GEMM,
    not the pass's others. The pairs are TE's (``module/base.py`` ``initialize_ub`` names the overlaps for the GEMMs,
    ``layernorm_linear.py`` / ``linear.py`` issue them) with megatron-core's defaults (``tp_comm_overlap_ag`` /
    ``_rs`` and ``tp_comm_bulk_dgrad`` / ``_wgrad`` on, ``tp_comm_overlap_rs_dgrad`` off: ``model_parallel_config.py``):
    F gathers QKV's and the first linear's inputs into their GEMMs and reduce-scatters the projection's and the
    second linear's outputs out of theirs (``qkv_fprop``, ``fc1_fprop``, ``proj_fprop``, ``fc2_fprop``; the last step
    of each reduce-scatter shows); B gathers the output gradients of the projection and the second linear into their
    input-gradient GEMMs (``proj_dgrad``, ``fc2_dgrad``) and reduce-scatters the input gradients of QKV and the first
    linear beside those linears' weight-gradient GEMMs (bulk ``qkv_wgrad``, ``fc1_wgrad``: W's GEMMs); W's re-gathers
    of QKV's and the first linear's inputs run beside those linears' input-gradient GEMMs (bulk ``qkv_dgrad``,
    ``fc1_dgrad``: B's). Shares by FLOPs, as for PyTorch's async TP (:func:`async_tp_collectives`)."""
    share = linear_shares(model, training.tp)
    ag = gather if fp8_gather is None else fp8_gather
    return (*_gathers_into_gemms(share, gather, ag),
            FusedCollective(1, gather, share["qkv"], under=2), FusedCollective(1, gather, share["fc1"], under=2),
            FusedCollective(2, ag, share["qkv"], under=1), FusedCollective(2, ag, share["fc1"], under=1))


def _gathers_into_gemms(share: dict[str, float], gather: float, ag: float) -> tuple[FusedCollective, ...]:
    """The six TP collectives PyTorch's async TP and TE's userbuffers both tie to one GEMM each: F's gathers into
    QKV and the first linear and reduce-scatters out of the projection and the second linear, B's gathers of the
    output gradients into the projection's and the second linear's input-gradient GEMMs (``ag``: an all-gather's
    seconds, FP8 where the operands are)."""
    return (FusedCollective(0, ag, share["qkv"]), FusedCollective(0, gather, share["proj"], scatter=True),
            FusedCollective(0, ag, share["fc1"]), FusedCollective(0, gather, share["fc2"], scatter=True),
            FusedCollective(1, ag, share["proj"]), FusedCollective(1, ag, share["fc2"]))


def linear_shares(model: ModelSpec, tp: int) -> dict[str, float]:
    """Each TP linear's share of a dense layer's linear FLOPs in a pass (its output width on the rank; the four
    linears of a pass share their rows): ``qkv``, ``proj``, ``fc1`` (gated: twice the MLP's width), ``fc2``."""
    m = model
    widths = {"qkv": (m.num_attention_heads + 2 * m.query_groups) * m.head_dim / tp,
              "proj": m.num_attention_heads * m.head_dim / tp,
              "fc1": m.ffn / tp * (2 if m.swiglu else 1), "fc2": m.ffn / tp}
    return {name: w / sum(widths.values()) for name, w in widths.items()}


def hybridep_timed(training: TrainingSpec, hardware: HardwareSpec, nodes: int) -> bool:
    """Whether the EP all-to-alls run on HybridEP inside one node where the hardware file gives its measured
    bandwidth (``hybridep_bandwidth_bytes_per_s``). The measured call ends with the copy of the received rows out
    of HybridEP's buffer, which is where megatron-core's ``dispatch_with_permute`` permutes them (and
    ``combine_with_unpermute`` unpermutes), so the rate holds the permutation; on the fabric's rates
    :func:`layer_comm` adds that copy (read and write of every copy, each way)."""
    return (training.hybridep
            and nodes == 1 and training.ep > 1 and hardware.hybridep_bandwidth_bytes_per_s is not None)


def hybridep_seconds(rows: float, ranks: int, hardware: HardwareSpec) -> float:
    """Seconds one HybridEP dispatch or combine of ``rows`` bytes over ``ranks`` inside a node takes: the rows at the
    measured ``hybridep_bandwidth_bytes_per_s``, plus ``hybridep_rank_latency_s`` for each rank beyond the first where
    the hardware file fits the two to a sweep over group sizes. Without that figure the bandwidth is one measured
    call's whole rate, latency included: the fabric's ring latency added on top would count it twice."""
    assert hardware.hybridep_bandwidth_bytes_per_s is not None
    return rows / hardware.hybridep_bandwidth_bytes_per_s + (ranks - 1) * (hardware.hybridep_rank_latency_s or 0.0)


def deepep_sm_bound(training: TrainingSpec, hardware: HardwareSpec, nodes: int, rows: float) -> float:
    """Seconds a DeepEP dispatch or combine of ``rows`` bytes inside one node takes at least for the SMs it holds
    (0 where the hardware file gives no rate, or for another dispatcher or across nodes).

    DeepEP's intranode normal kernels (deepseek-ai/DeepEP ``csrc/kernels/intranode.cu``; Primus-Turbo's port,
    AMD-AGI/Primus-Turbo ``csrc/kernels/deep_ep/intranode.cu``) run one channel per pair of SMs, the even one
    sending rows into the peers' buffers, the odd one copying what arrives out of its own, so the rows a call moves
    per second grow with the SMs it is given until the fabric binds: on B200, 4,096 tokens of 7,168, top-8 of 64
    experts at random, BF16, the combine's algorithm bandwidth is 302, 420, 477 and 524 GB/s at 16, 24, 28 and 32
    SMs (deepseek-ai/DeepEP branch hybrid-ep, docs/README_Hybrid-EP.md, "B200 Platform", DeepEP "Torch API" rows):
    the rate per SM (``HardwareSpec.deepep_sm_bandwidth_bytes_per_s``) times the SMs. DeepEP's benchmark
    (tests/test_intranode.py) times the Python call with the layout cached (``buffer.dispatch(handle=...)``), so the
    rate holds no ``notify_dispatch`` and no host wait for the received counts, which a forward's dispatch adds: the
    projection prices that wait as the MoE layer's host sync (:func:`~primuspipe.projection.host.waits_for_token_counts`).
    Both directions are priced at the combine's rate, the lower (as for HybridEP)."""
    rate = hardware.deepep_sm_bandwidth_bytes_per_s
    t = training
    if (rate is None or t.moe_token_dispatcher_type != "flex" or t.moe_flex_dispatcher_backend != "deepep"
            or nodes > 1):
        return 0.0
    return rows / (t.dispatcher_sms * rate)


def destination_ranks(model: ModelSpec, training: TrainingSpec) -> float:
    """EP ranks one token's ``k`` experts live on, on average: what the flex dispatcher sends it to inside a node.

    DeepEP's dispatch sends a token once to every rank where ``is_token_in_rank`` (``get_dispatch_layout`` over
    its top-k expert ids; deep_ep/buffer.py ``dispatch`` and csrc/kernels/intranode.cu, deepseek-ai/DeepEP
    79bbb54), and the receiver expands it to one copy per local expert (megatron-core's flex dispatcher:
    ``fused_indices_to_multihot`` then ``permute``; NeMo AutoModel's copy of it,
    nemo_automodel/components/moe/megatron/token_dispatcher.py); the combine returns one sum per rank.
    HybridEP does the same: its permuted output holds up to ``min(topk, experts per rank)`` copies of each
    received token (DeepEP branch hybrid-ep, docs/Hybrid-EP_Implementation.md, "worst_case_dispatch_output x
    min(topk, num_experts_per_rank)"), and so does Primus-Turbo's DeepEP port, which keeps DeepEP's
    ``is_token_in_rank`` layout (AMD-AGI/Primus-Turbo a6a16cdc, benchmark/ops/training/deep_ep/test_intranode.py).

    Which ranks: a router's picks (:func:`destinations`, megatron-core's forced balance by random logits included);
    a round-robin (AutoModel's ``fake_balanced_gate``, Primus's ``even`` forced balance:
    :attr:`TrainingSpec.round_robin_routing`) gives token ``i`` experts ``i k`` ... ``i k + k - 1`` (mod ``E``),
    counted exactly over one period of its starting expert."""
    return token_destinations(model, training, model.num_experts // training.ep)


def token_destinations(model: ModelSpec, training: TrainingSpec, experts_each: int) -> float:
    """Destinations (EP ranks, or nodes) one token's ``k`` experts live on, on average, where each destination
    holds ``experts_each`` consecutive experts: the router's picks (:func:`destinations`), or under a round-robin
    (:attr:`TrainingSpec.round_robin_routing`, see :func:`destination_ranks`) counted exactly over one period of
    a token's starting expert. Across nodes DeepEP sends a token once to every node holding one of its experts,
    so the count with ``experts_each`` = the experts of a node is what crosses the network: AutoModel's fake gate
    (nemo_automodel/components/moe/layers.py ``FakeBalancedGate``: ``arange(T k).view(-1, k) % E``) puts
    DeepSeek-V3's eight consecutive experts in one node of 32 at EP 64, where the router's group-limited picks
    reach about four."""
    experts, k = model.num_experts, model.moe_router_topk
    if training.round_robin_routing:
        starts = range(0, experts * k // math.gcd(experts, k), k)
        return sum(len({(s + j) % experts // experts_each for j in range(k)}) for s in starts) / len(starts)
    return destinations(model, experts_each)


def p2p_message_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """One activation crossing a stage boundary (sequence parallelism sends each rank's shard)."""
    return RankShape(model, training).hidden_bytes


def pipeline_ranks_per_node(training: TrainingSpec, hardware: HardwareSpec) -> int:
    """Consecutive pipeline ranks sharing a node (1 when one stage's TP*CP*DP ranks fill a node or more)."""
    return max(1, hardware.gpus_per_node // (training.tp * training.cp * training.dp))


@dataclass(frozen=True)
class SyncCollectives:
    """One rank's data-parallel collectives of a step, each the time it takes once (dense and expert groups
    together), before any overlap: what :func:`gradient_sync` hides or shows."""
    reduce: float
    """The gradients' reduction (all-reduce, or reduce-scatter under the distributed optimizer)."""
    gather: float
    """The updated weights' all-gather (distributed optimizer only)."""
    held_reduce: float = 0.0
    """The part of :attr:`reduce` that FP8 weights' merged BF16 buckets hold back to the backward's end."""
    held_gather: float = 0.0
    """The part of :attr:`gather` they put first, before the first layer's forward."""
    compute_share: float = 0.0
    """The time-weighted share of the compute units they hold while they run (:meth:`Collectives.compute_share`)."""


def sync_collectives(params: ParamCount, training: TrainingSpec, net: Collectives, buffer: DenseBuffer,
                     first_rank: bool, aligned: bool) -> SyncCollectives:
    """The step's data-parallel collectives of one rank (:class:`SyncCollectives`).

    Under FP8 weights (``fp8_param_gather``) the rank's BF16 parameters (``buffer.unquantized``: embedding,
    output layer, norms) are gathered in two bytes, and megatron-core merges every bucket of their buffer into
    the *last* FP8 bucket group (``partition_buckets``, ``distributed/param_and_grad_buffer.py``, "merge all
    non-fp8 buckets into the last fp8 bucket group"; DistributedDataParallel's, not Megatron-FSDP's or
    PyTorch's): on the pipeline's first rank (``first_rank``, the one whose backward ends the step and whose
    forward starts it) that group is reduced only once the embedding's gradient is ready, after the whole
    backward, and gathered first, before the first layer's forward -- so their bytes join the last bucket that
    shows. With ``align_param_gather`` (``aligned``) every bucket group's gather is one collective (and its
    latency) of its own (:func:`bucket_groups`)."""
    t = training
    grad_bytes = t.main_grad_bytes  # mixed precision accumulates and reduces in fp32 unless told otherwise
    wide = 4 if t.precision == "fp32" else 2
    unquantized = buffer.unquantized if t.fp8_param_gather else 0
    span = t.tp * t.cp * t.dp
    dense_ranks, expert_ranks = t.dense_data_parallel_size, t.expert_data_parallel_size
    if t.use_distributed_optimizer:
        calls = bucket_groups(params.dense, buffer, t) if aligned and first_rank else 1  # DDP buckets only the first
        reduce = net.gather(params.dense * grad_bytes, dense_ranks, span)
        weights = (params.dense - unquantized) * gathered_weight_bytes(t) + unquantized * wide
        gather = calls * net.gather(weights / calls, dense_ranks, span)
        held_reduce = reduce * unquantized / params.dense if params.dense else 0.0
        held_gather = gather * unquantized * wide / weights if weights else 0.0
        expert = (net.gather(params.expert * grad_bytes, expert_ranks, span),
                  net.gather(params.expert * gathered_weight_bytes(t), expert_ranks, span))
    else:
        reduce = net.all_reduce(params.dense * grad_bytes, dense_ranks, span)
        expert = (net.all_reduce(params.expert * grad_bytes, expert_ranks, span), 0.0)
        gather = held_reduce = held_gather = 0.0
    busy = (reduce + gather) * net.compute_share(dense_ranks, span) + sum(expert) * net.compute_share(expert_ranks, span)
    reduce, gather = reduce + expert[0], gather + expert[1]
    if not (first_rank and not t.use_megatron_fsdp):  # the merged buckets are DistributedDataParallel's
        held_reduce = held_gather = 0.0
    return SyncCollectives(reduce, gather, held_reduce, held_gather,
                           busy / (reduce + gather) if reduce + gather else 0.0)


def shown_reduce(c: SyncCollectives, training: TrainingSpec, tail: float, compute_s: float,
                 backward_s: float) -> tuple[float, float]:
    """(Seconds the gradient reduction runs in a step, seconds of it that show.)

    Megatron reduces gradients bucket by bucket as backward produces them (``overlap_grad_reduce``); they
    accumulate locally over the microbatches and are reduced only during the last microbatch's backward
    (``no_sync`` for the others), so one microbatch's backward (``backward_s``) hides them: of the buckets
    (``tail``: the last one's share) the last shows, or what outlasts that backward, whichever is longer, and
    the FP8 weights' held part shows whole. A step of several pipeline schedules
    (:attr:`TrainingSpec.local_batch_size`) reduces in each schedule's last backward
    (``torch.distributed.pipelining``'s stage syncs its DDP module there): once per flush.

    With gradients sharded (Megatron-FSDP ``optim_grads``) every microbatch's gradients are reduce-scattered
    as its backward produces them, not once per step. Nothing waits for those collectives before the
    optimizer step, so they run on their own stream beside all later compute, forward included: what
    outlasts the rank's compute per microbatch (``compute_s``: its F, B and W seconds) shows for every
    microbatch, or at least the last bucket of the last one. (The network is taken as the data-parallel
    group's alone: pipeline sends share it, and are small beside gradients.)"""
    t, reduce = training, c.reduce
    if t.shards_gradients:
        run = reduce * t.microbatches
        return run, (max(reduce * tail, t.microbatches * max(0.0, reduce - compute_s)) if t.overlap_grad_reduce
                     else run)
    run = reduce * t.pipeline_flushes
    return run, (max(c.held_reduce + (reduce - c.held_reduce) * tail, reduce - backward_s) * t.pipeline_flushes
                 if t.overlap_grad_reduce else run)


def shown_gather(c: SyncCollectives, training: TrainingSpec, tail: float, compute_s: float, forward_s: float,
                 aligned: bool) -> tuple[float, float]:
    """(Seconds the weights' all-gather runs in a step, seconds of it that show.)

    Megatron gathers the updated weights bucket by bucket as the next forward needs them
    (``overlap_param_gather``), ahead of the first microbatch's forward only (the forward pre-hook waits for a
    bucket and launches the next): one microbatch's forward (``forward_s``) hides them but the first bucket
    (``tail``'s share) and the FP8 weights' held part. With ``align_param_gather`` outside the interleaved
    schedule (``aligned``) every bucket group's gather is launched by its own forward pre-hook and waited on at
    once: the whole gather shows.

    With the weights sharded (``optim_grads_params``) every microbatch gathers each layer's weights before its
    forward and again before its backward, prefetched under the layer before: what outlasts the compute
    (``compute_s``) shows, as for the reduction; no gather is left for the step's end. PyTorch FSDP2 without
    resharding after forward gathers them once a microbatch, and under PyTorch's pipelining once a schedule,
    before its first forward, reducing the gradients in its last microbatch's backward as unsharded ones are
    (``TrainingSpec.fsdp_reshard_after_forward``)."""
    t, gather = training, c.gather
    if t.shards_weights and not t.gathered_for_step:
        passes = 2 if t.fsdp_reshard_after_forward else 1  # before the forward, and again before the backward
        run = passes * gather * t.microbatches
        return run, t.microbatches * max(0.0, passes * gather - compute_s) if t.overlap_param_gather else run
    flushes = t.pipeline_flushes if t.gathered_for_step else 1  # each schedule gathers its stage's weights anew
    if t.overlap_param_gather and not aligned:
        return gather * flushes, max(c.held_gather + (gather - c.held_gather) * tail, gather - forward_s) * flushes
    return gather * flushes, gather * flushes


def gradient_sync(params: ParamCount, training: TrainingSpec, hardware: HardwareSpec, *, tied_embedding: float = 0.0,
                  buckets: int = 1, forward_s: float = 0.0, backward_s: float = 0.0,
                  buffer: DenseBuffer = DenseBuffer(), first_rank: bool = False) -> float:
    """Seconds one rank's data-parallel gradient reduction and weight all-gather add to the step;
    ``tied_embedding`` are the embedding parameters whose gradients the first and last stage all-reduce.

    What the collectives take (:func:`sync_collectives`), how much of the reduction and of the gather the
    rank's compute hides (:func:`shown_reduce`, :func:`shown_gather`: of ``buckets`` roughly equal buckets --
    one per layer of the rank -- the compute of one microbatch, ``forward_s`` and ``backward_s``, hides all but
    the last, or what outlasts it); that matters where the gradients are large beside one microbatch's
    compute: a rank's many experts replicated over an expert-data-parallel group that crosses the network,
    with few microbatches.

    What the compute hides is not free for it: a collective's CTAs (channels) hold compute units the kernels beside
    it cannot use (:meth:`Collectives.compute_share`; inside a node where the hardware file gives RCCL's channel
    counts), so the compute that runs beside the hidden part takes
    ``1 / (1 - share)`` as long, as under DeepEP's dispatcher (:meth:`LayerComm.exposed`); that extra time shows."""
    t, net = training, Collectives(hardware)
    ddp = not t.use_megatron_fsdp  # the bucket groups are DistributedDataParallel's
    aligned = ddp and t.overlap_param_gather and t.align_param_gather and t.vpp == 1  # no gather runs ahead
    c = sync_collectives(params, t, net, buffer, first_rank, aligned)
    tail = 1 / max(1, buckets)
    run_reduce, reduce = shown_reduce(c, t, tail, forward_s + backward_s, backward_s)
    run_gather, gather = shown_gather(c, t, tail, forward_s + backward_s, forward_s, aligned)
    tied = net.all_reduce(tied_embedding * t.main_grad_bytes, 2, t.tp * t.cp * t.dp * t.pp)
    hidden = max(0.0, run_reduce + run_gather - reduce - gather)
    return gather + tied + reduce + hidden * c.compute_share / (1 - c.compute_share)


def bucket_groups(dense: int, buffer: DenseBuffer, training: TrainingSpec) -> int:
    """Bucket groups of a rank's ``dense`` parameters (the first chunk's, the one DDP cuts into buckets):
    buckets of ``ddp_bucket_size`` parameters, each closed only after a whole tensor, so at most one a tensor
    (``_ParamAndGradBuffer``, ``distributed/param_and_grad_buffer.py``). Under FP8 weights only the FP8 buffer's
    buckets count, the BF16 one's joining its last (:func:`gradient_sync`); otherwise each bucket is a group."""
    t = training
    size = t.ddp_bucket_size or max(40_000_000, 1_000_000 * t.dp)
    if t.fp8_param_gather:
        count, tensors = dense - buffer.unquantized, buffer.weights
    else:
        count, tensors = dense, buffer.weights + buffer.others
    return max(1, min(math.ceil(count / size), tensors or math.inf))


def gathered_weight_bytes(training: TrainingSpec) -> int:
    """Bytes per weight the data-parallel weight all-gather moves under mixed precision. With FP8 weights
    (``fp8_param_gather``) megatron-core keeps a tensor-scaled FP8 weight's bucket as ``torch.uint8``
    (``distributed/distributed_data_parallel.py``: a ``Float8Tensor``'s data "is stored in the form of a torch
    uint8 tensor", so its buffer is uint8) and gathers one byte; MXFP8 weights are gathered in BF16 into the
    gradient buffer and cast to MXFP8 as they are copied out (``reuse_grad_buf_for_mxfp8_param_ag``,
    ``param_and_grad_buffer.py``), two bytes."""
    return 1 if training.fp8_param_gather and training.fp8_recipe != "mxfp8" else 2


