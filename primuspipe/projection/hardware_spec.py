"""The cluster: one accelerator's compute and memory, and the links between accelerators.

A hardware YAML lists the fields of :class:`HardwareSpec` (``examples/projection/hardware/`` has the
MI300X, MI355X, H100 and H200 with their published figures). Bandwidths are bytes per second in one
direction, latencies seconds; ``*_fraction`` fields say how much of a peak real kernels reach.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING, Literal

from primuspipe.projection.spec_fields import InputError, check_fields, read_yaml, spec_from_mapping

if TYPE_CHECKING:
    from primuspipe.projection.training_spec import TrainingSpec


@dataclass(frozen=True)
class AttentionKernel:
    """One fused-attention kernel's rates on an accelerator, as published for it (an entry of
    :attr:`HardwareSpec.attention_kernels`): a run that names it (its training's ``attention_kernel``) is timed at
    these in place of the file's ``attention_efficiency``, ``attention_length_rates`` and
    ``attention_backward_length_rates``, which stand for the kernels of today's libraries; older containers ran
    slower ones (FlashAttention-2, an earlier cuDNN), most visibly where attention is most of the step."""

    efficiency: float
    """The forward's share of the bf16 peak at 8,192 tokens a sequence, as ``attention_efficiency``."""
    length_rates: tuple[tuple[float, float], ...]
    """The forward's rate by sequence length relative to ``efficiency``, as ``attention_length_rates``."""
    backward_length_rates: tuple[tuple[float, float], ...]
    """The backward's, relative to ``efficiency`` alike, as ``attention_backward_length_rates``."""

    def __post_init__(self) -> None:
        check_fields(self)  # its ranges are the hardware file's to check, where it is named (HardwareSpec)


@dataclass(frozen=True)
class HardwareSpec:
    """One node type of a homogeneous cluster."""

    peak_bf16_tflops: float
    """Dense (no sparsity) bf16/fp16 matrix throughput of one accelerator, TFLOP/s."""
    hbm_bytes: float
    """Memory of one accelerator, bytes."""
    hbm_bandwidth_bytes_per_s: float
    """Peak memory bandwidth of one accelerator."""
    intra_node_bandwidth_bytes_per_s: float
    """One accelerator's bandwidth into its node's fabric (NVLink / Infinity Fabric), used by collectives."""
    inter_node_bandwidth_bytes_per_s: float
    """One accelerator's share of the network between nodes (its NIC)."""
    name: str = "accelerator"
    """Shown in reports."""
    achievable_fraction: float = 0.6
    """Share of the bf16 peak that large GEMMs and flash attention sustain (clock throttling, wave
    quantisation); fp32 runs at half of it on top."""
    memory_bandwidth_fraction: float = 0.8
    """Share of the HBM bandwidth that element-wise kernels (norms, activations, softmax) sustain."""
    mxfp8_cast_bandwidth_fraction: float | None = None
    """Share of the HBM bandwidth Transformer Engine's MXFP8 quantize kernels sustain (bf16 in, row-wise and
    column-wise FP8 with their E8M0 scales out); None: ``memory_bandwidth_fraction``."""
    intra_node_peer_bandwidth_bytes_per_s: float | None = None
    """Bandwidth between two accelerators of a node (point-to-point pipeline sends); None means
    intra_node_bandwidth (a switched fabric); a fully connected mesh gives one link's bandwidth here."""
    intra_node_topology: Literal["switch", "full-mesh"] = "switch"
    """How the node's accelerators are joined. ``switch`` (NVLink through NVSwitch): every accelerator reaches the
    fabric at ``intra_node_bandwidth`` whoever its peers are, so any group inside a node has it. ``full-mesh``
    (AMD's Infinity Fabric / xGMI on MI300X, MI325X, MI355X platforms: each GPU linked directly to each of the
    other seven, no switch): a GPU's bandwidth is its links', one to each peer, so a group of ``k`` GPUs of a node
    has only the ``k - 1`` links among its members (:meth:`group_fabric_bandwidth`); needs
    ``intra_node_peer_bandwidth_bytes_per_s``, one link's bandwidth."""
    intra_node_latency_s: float = 5e-6
    """Start-up time of one message or collective step inside a node."""
    inter_node_latency_s: float = 1e-5
    """Start-up time of one message or collective step between nodes."""
    network_efficiency: float = 0.8
    """Share of link bandwidth that collectives and sends reach."""
    gpus_per_node: int = 8
    """Accelerators sharing the intra-node fabric."""
    peak_fp8_tflops: float | None = None
    """Dense FP8 matrix throughput, TFLOP/s; None: the accelerator has no FP8 GEMMs (FP8 training is refused)."""
    block_scaled_fp8: bool = False
    """Whether the matrix units scale FP8 per block in hardware (MXFP8: Blackwell, MI355X)."""
    fp8_gemm_any_layout: bool = False
    """Whether FP8 GEMMs take either operand in either layout (Blackwell), so per-tensor FP8 casts write no
    transposed copies; Hopper's take both K-major (``compute.WorkModel._transpose_bytes``)."""
    gemm_efficiency: float | None = None
    """Share of the bf16 peak the best-shaped large GEMM sustains (its measured Maximum Achievable Matmul
    FLOPS / peak). Set, GEMM times follow their shapes (tiles, waves, roofline: :mod:`~primuspipe.projection.gemm`);
    None: every GEMM at ``achievable_fraction``."""
    fp8_gemm_efficiency: float | None = None
    """The same for FP8 GEMMs (share of ``peak_fp8_tflops``); None: ``gemm_efficiency``."""
    mxfp8_gemm_efficiency: float | None = None
    """The same for MXFP8 (block-scaled) GEMMs; None: ``fp8_gemm_efficiency``."""
    gemm_half_intensity: float | None = None
    """The arithmetic intensity (multiply-adds per element read or written, ``m n k / (m k + k n + m n)``) at which
    a GEMM runs at half its efficiency: a GEMM's rate is ``gemm_efficiency`` (or the FP8 / MXFP8 one) times
    ``I / (I + gemm_half_intensity)`` (:func:`~primuspipe.projection.gemm.shape_fraction`), fitted to measured GEMMs
    over shapes (``measurements/gemm.yaml`` beside the shipped hardware files). None: every GEMM at the efficiency
    (the curve flat)."""
    sustained_fraction: float = 1.0
    """Share of those isolated-kernel rates (GEMMs, attention) a training step sustains: clocks drop when
    every unit, HBM and the links are busy at once, and overlapped communication kernels hold compute units.
    Used with ``gemm_efficiency`` only (``achievable_fraction`` already is an in-training figure)."""
    fp8_sustained_fraction: float | None = None
    """``sustained_fraction`` for FP8 GEMMs (per-tensor and MXFP8), where the power-saturated clock drop was
    measured apart for FP8 matmuls and differs from the BF16 one the main figure takes; None: ``sustained_fraction``."""
    compute_units: int | None = None
    """Streaming multiprocessors / compute units GEMM tiles are spread over (wave quantisation)."""
    gemm_tile: tuple[int, ...] = (128, 256)
    """Output tile (rows, columns) of one GEMM work unit."""
    gemm_min_tile: tuple[int, ...] | None = None
    """The smallest output tile (rows, columns) the GEMM library picks for a shape that would leave units idle with
    ``gemm_tile`` (:func:`~primuspipe.projection.gemm.library_tile`: ``gemm_tile`` halved per side down to this);
    None: every GEMM with ``gemm_tile``."""
    attention_efficiency: float | None = None
    """Share of the bf16 peak fused (flash) attention sustains, forward and backward (the backward's own rate relative
    to it where ``attention_backward_length_rates`` is given); None: achievable_fraction."""
    attention_length_rates: tuple[tuple[float, float], ...] | None = None
    """Fused attention's rate against the sequence length one kernel sees: ``[length, rate]`` pairs, the rate
    relative to the one ``attention_efficiency`` stands for (1 at 8,192); lengths between pairs interpolate
    on a log scale, outside them the nearest pair holds. None: one rate at every length."""
    attention_backward_length_rates: tuple[tuple[float, float], ...] | None = None
    """The backward kernels' rate against the sequence length, as ``attention_length_rates`` (relative to the rate
    ``attention_efficiency`` stands for, interpolated alike): a fused attention backward recomputes the scores and
    writes three gradients, so it runs below its forward, and further below at short sequences. None: the
    backward at ``attention_length_rates``, as the forward."""
    attention_head_dim_rates: tuple[tuple[float, float], ...] | None = None
    """Fused attention's rate against the head dimension: ``[head dim, rate]`` pairs, the rate relative to the one
    ``attention_efficiency`` stands for (1 at 128); interpolated and held outside the pairs as the length
    rates are. None: one rate at every head dimension."""
    attention_backward_head_dim_rates: tuple[tuple[float, float], ...] | None = None
    """The backward kernels' rate against the head dimension, as ``attention_head_dim_rates`` (1 at 128): where narrow
    heads cost the two passes differently (cuDNN on Blackwell: see ``b200.yaml``). None: the backward at
    ``attention_head_dim_rates``, as the forward."""
    attention_kernels: dict[str, AttentionKernel] | None = None
    """Other fused-attention kernels a run may name in its training's ``attention_kernel``, by name: each replaces
    the three figures above for that run (:meth:`with_attention_kernel`); the head-dimension rates and
    ``attention_dropout_rate`` stay the file's. None: no kernel can be named."""
    attention_dropout_rate: float = 1.0
    """Fused attention's rate with ``attention_dropout`` on, as a share of its rate without (the kernel draws a
    Philox random number per score and masks the probabilities inside); 1: dropout taken as free, where the file
    gives no measurement."""
    runtime_reserved_bytes: float = 0.0
    """HBM no tensor can use: the CUDA/HIP context, the caching allocator's fragmentation reserve, NCCL/RCCL
    communicator buffers, GEMM workspaces (added to every rank's peak)."""
    host_op_seconds: float | None = None
    """Host (CPU) time to issue one framework op from Python through PyTorch (:mod:`~primuspipe.projection.host`);
    None: host time is not modelled (the GPU is never waiting for the host)."""
    host_launch_seconds: float | None = None
    """Host time of one kernel launch issued from C++ (a grouped GEMM's per-expert GEMMs); None: 0."""
    moe_sync_host_op_seconds: float | None = None
    """Host time per framework op of an MoE layer whose forward waits for token counts on the host (dropless
    dispatch), where the platform's launch path around such a sync is slower than ``host_op_seconds`` says
    (the MI355X's: AMD names device-to-host syncs that stall the launch queue); it prices every pass of such
    a layer, and only of such a layer (its per-expert launches stay at ``host_launch_seconds``). None:
    ``host_op_seconds`` prices it as any other layer."""
    moe_kernel_seconds: float | None = None
    """Device time each kernel of an MoE layer's routing, dispatch and expert loop takes beyond the work the
    model prices (its launch, and the ramp-up and drain of a grid small against the device): those kernels
    work on routing metadata or one expert's share of the tokens, where that fixed cost is a large share,
    while the full-microbatch kernels the fitted ``sustained_fraction`` stands for carry theirs inside it.
    Counted by :func:`~primuspipe.projection.host.moe_small_kernels`; None: not modelled."""
    stream_launch_gap_seconds: float | None = None
    """Device time between back-to-back kernels launched into a stream by the host that a CUDA graph's replay of
    the same kernels does not take (the front end's per-launch work; a grid's ramp-up and drain stay, in
    ``moe_kernel_seconds``). Added to each small MoE kernel no graph captures; None: graphs shorten nothing."""
    hybridep_bandwidth_bytes_per_s: float | None = None
    """HybridEP's measured algorithm bandwidth inside one node: the bytes a rank receives in a dispatch (one row
    per token and destination rank, its own included) or sends in a combine, over the time of the call as
    megatron-core makes it (the "Torch API" figure of DeepEP's hybrid-ep benchmark). It times the flex
    dispatcher's all-to-alls on HybridEP inside a node in place of the fabric's ``intra_node_bandwidth`` x
    ``network_efficiency``. None: the fabric's figure."""
    hybridep_rank_latency_s: float | None = None
    """Seconds each rank of the expert group beyond the first adds to a HybridEP call inside a node, fitted together
    with ``hybridep_bandwidth_bytes_per_s`` to a published sweep of the call over group sizes: a call takes its rows
    over that bandwidth plus ``(EP - 1)`` times this. None: the bandwidth is one measured call's whole rate (its
    latency inside it), and nothing is added."""
    deepep_sm_bandwidth_bytes_per_s: float | None = None
    """Bytes per second each SM (compute unit) that DeepEP's intranode normal kernels hold moves: the kernels copy
    token rows channel by channel, a channel per pair of SMs, so until the fabric binds a call's algorithm
    bandwidth (the bytes a rank receives in a dispatch, one row per token and destination rank, its own included,
    or sends in a combine, over the call's time) grows with the SMs given to it. A flex-dispatcher call inside a node
    on DeepEP takes the longer of the fabric's time and its rows over ``dispatcher SMs x`` this
    (:func:`~primuspipe.projection.comm.layer_comm`). None: the fabric's time alone."""
    collective_ctas_per_card: int | None = None
    """Thread blocks (CTAs) NCCL's ring collectives run on each GPU per network card the group's members on a node
    use, across nodes: NCCL builds a ring (channel) per card and doubles the rings, each ring a CTA, and a CTA never
    shares its SM with a compute kernel (NVIDIA/nccl issue 689, the NCCL maintainer: a single-NIC system "should just
    launch 2 SMs", "DGX with 8 NICs ... would use 16 SMs"; "NCCL CTAs won't share an SM with compute kernels"). Compute
    that an overlapped data-parallel collective runs beside takes ``1 / (1 - CTAs / compute_units)`` as long
    (:func:`~primuspipe.projection.comm.gradient_sync`). None: overlapped collectives across nodes take no compute
    units (inside one node see ``intra_node_collective_channels``)."""
    intra_node_collective_channels: tuple[tuple[int, int], ...] | None = None
    """Channels (thread blocks, each on a compute unit of its own) the collective library's ring collectives run on
    each GPU inside one node, by the group's size: ``[GPUs, channels]`` pairs; a group of a size between pairs takes
    the largest listed size below it. RCCL sizes them by the members on the node (on the MI355X 32 for 2 GPUs, 48
    for 4, 112 for 8) and every channel is a workgroup that holds its CU while the collective runs, so compute
    beside an overlapped data-parallel collective inside a node takes ``1 / (1 - channels / compute_units)`` as long
    (:func:`~primuspipe.projection.comm.gradient_sync`), as across nodes with ``collective_ctas_per_card``. None:
    groups inside one node hold no compute units (no source gives NCCL's count on NVLink)."""
    scatter_add_elements_per_s: float | None = None
    """Elements per second PyTorch's accumulating scatters (``scatter_add_``, ``index_add_``: a write that adds into
    its destination instead of overwriting it) reach on this accelerator for bf16 token rows. megatron-core's
    unfused MoE permutation runs two per layer and microbatch -- the unpermutation's ``scatter_add_`` forward and
    the permutation's ``index_select`` backward (``index_add_``) -- over every token copy's row; where this is given
    they are priced at it instead of as plain copies (:meth:`~primuspipe.projection.compute.WorkModel.
    accumulating_scatters`). None: priced as copies, as a fused permutation's kernels are."""
    source: str = "<built-in>"
    """Where the values came from; named in error messages."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("peak_bf16_tflops", "hbm_bytes", "hbm_bandwidth_bytes_per_s", "intra_node_bandwidth_bytes_per_s",
                     "inter_node_bandwidth_bytes_per_s", "intra_node_peer_bandwidth_bytes_per_s", "gpus_per_node",
                     "peak_fp8_tflops", "compute_units", "host_op_seconds", "host_launch_seconds",
                     "moe_sync_host_op_seconds", "moe_kernel_seconds", "stream_launch_gap_seconds",
                     "gemm_half_intensity", "hybridep_bandwidth_bytes_per_s", "hybridep_rank_latency_s",
                     "scatter_add_elements_per_s",
                     "deepep_sm_bandwidth_bytes_per_s", "collective_ctas_per_card"):
            if getattr(self, name) == 0:
                raise InputError([(self.source, name, 0)], "must be positive", "give the accelerator's published figure")
        if self.hybridep_rank_latency_s is not None and self.hybridep_bandwidth_bytes_per_s is None:
            raise InputError([(self.source, "hybridep_rank_latency_s", self.hybridep_rank_latency_s)],
                             "is fitted together with hybridep_bandwidth_bytes_per_s, which the file does not give",
                             "give both figures of the fit, or neither")
        for name, what, example in (("attention_length_rates", "sequence length", "[[2048, 0.92], [8192, 1.0]]"),
                                    ("attention_backward_length_rates", "sequence length", "[[2048, 0.64], [8192, 0.83]]"),
                                    ("attention_head_dim_rates", "head dimension", "[[64, 0.63], [128, 1.0]]"),
                                    ("attention_backward_head_dim_rates", "head dimension", "[[64, 0.6], [128, 1.0]]")):
            _check_rates(self.source, name, getattr(self, name) or (), what, example)
        for name, kernel in (self.attention_kernels or {}).items():
            _check_rates(self.source, f"attention_kernels.{name}.length_rates", kernel.length_rates, "sequence length",
                         "[[2048, 0.92], [8192, 1.0]]")
            _check_rates(self.source, f"attention_kernels.{name}.backward_length_rates", kernel.backward_length_rates,
                         "sequence length", "[[2048, 0.64], [8192, 0.83]]")
            if not MIN_FRACTION <= kernel.efficiency <= 1:
                raise InputError([(self.source, f"attention_kernels.{name}.efficiency", kernel.efficiency)],
                                 f"a fraction must be in [{MIN_FRACTION:g}, 1]",
                                 "give the kernel's share of the bf16 peak, e.g. 0.53")
        if len(self.gemm_tile) != 2 or min(self.gemm_tile) < 1 or max(self.gemm_tile) > MAX_TILE:
            raise InputError([(self.source, "gemm_tile", list(self.gemm_tile))],
                             f"a tile is two positive sizes of at most {MAX_TILE}",
                             "give [rows, columns], e.g. [128, 256]")
        if self.gemm_min_tile is not None and (len(self.gemm_min_tile) != 2 or min(self.gemm_min_tile) < 1 or any(
                small > large for small, large in zip(self.gemm_min_tile, self.gemm_tile))):
            raise InputError([(self.source, "gemm_min_tile", list(self.gemm_min_tile))],
                             "the smallest tile is two positive sizes, each at most gemm_tile's",
                             f"give [rows, columns] no larger than gemm_tile {list(self.gemm_tile)}, e.g. [128, 128]")
        for name in ("achievable_fraction", "memory_bandwidth_fraction", "network_efficiency", "gemm_efficiency",
                     "fp8_gemm_efficiency", "attention_efficiency", "sustained_fraction", "fp8_sustained_fraction",
                     "mxfp8_cast_bandwidth_fraction",
                     "mxfp8_gemm_efficiency", "attention_dropout_rate"):
            if getattr(self, name) is None:
                continue
            if not MIN_FRACTION <= getattr(self, name) <= 1:
                raise InputError([(self.source, name, getattr(self, name))],
                                 f"a fraction must be in [{MIN_FRACTION:g}, 1]",
                                 "give the share of the peak that real kernels reach, e.g. 0.6")
        for name, (low, high, unit) in SPANS.items():
            value = getattr(self, name)
            if value is not None and value != 0 and not low <= value <= high:
                raise InputError([(self.source, name, value)], f"lies outside [{low:g}, {high:g}] {unit}, beyond any "
                                 "accelerator or link (the projection's times would not stay numbers)",
                                 f"give the figure in {unit}" + (" (or 0 for none)" if unit == "seconds" else ""))

        if self.intra_node_topology == "full-mesh" and self.intra_node_peer_bandwidth_bytes_per_s is None:
            raise InputError([(self.source, "intra_node_topology", self.intra_node_topology),
                              (self.source, "intra_node_peer_bandwidth_bytes_per_s", None)],
                             "a fully connected mesh needs the bandwidth of one of its links",
                             "give intra_node_peer_bandwidth_bytes_per_s (one link, one direction, e.g. 76.8e+9)")
        if self.collective_ctas_per_card and self.compute_units and \
                self.collective_ctas_per_card * self.gpus_per_node >= self.compute_units:
            raise InputError([(self.source, "collective_ctas_per_card", self.collective_ctas_per_card),
                              (self.source, "gpus_per_node", self.gpus_per_node),
                              (self.source, "compute_units", self.compute_units)],
                             "a node's collectives (CTAs per card times the node's cards) would hold every compute unit",
                             "give NCCL's CTAs per network card, e.g. 2, and the node's real GPU and SM counts")

        pairs = self.intra_node_collective_channels or ()
        if any(len(pair) != 2 or not 2 <= pair[0] <= self.gpus_per_node or not self.compute_units
               or not 1 <= pair[1] < self.compute_units for pair in pairs) or len({p[0] for p in pairs}) < len(pairs):
            raise InputError([(self.source, "intra_node_collective_channels", [list(p) for p in pairs]),
                              (self.source, "gpus_per_node", self.gpus_per_node),
                              (self.source, "compute_units", self.compute_units)],
                             "each entry is [group size of 2 to the node's GPUs, fewer channels than compute units], "
                             "each size once",
                             "give [GPUs, channels] pairs, e.g. [[2, 32], [8, 112]], and the GPU's compute_units")

    def fp8_peak_tflops(self) -> float:
        if self.peak_fp8_tflops is None:
            raise InputError([(self.source, "peak_fp8_tflops", None)], "FP8 training on an accelerator without an FP8 peak",
                             "give peak_fp8_tflops (the dense FP8 figure of its data sheet) or train in bf16")
        return self.peak_fp8_tflops

    @property
    def mxfp8_cast_fraction(self) -> float:
        """Share of the HBM bandwidth MXFP8 quantize kernels run at."""
        return (self.memory_bandwidth_fraction if self.mxfp8_cast_bandwidth_fraction is None
                else self.mxfp8_cast_bandwidth_fraction)

    @property
    def attention_fraction(self) -> float:
        if self.gemm_efficiency is None:
            return self.attention_efficiency if self.attention_efficiency is not None else self.achievable_fraction
        return (self.attention_efficiency or self.achievable_fraction) * self.sustained_fraction

    def attention_rate(self, length: float | None, head_dim: float | None = None, backward: bool = False) -> float:
        """``attention_length_rates`` at ``length`` queries per kernel times ``attention_head_dim_rates`` at
        ``head_dim`` (for the ``backward`` kernels their ``attention_backward_*`` tables where given; each 1 without
        its table or its value)."""
        lengths = (backward and self.attention_backward_length_rates) or self.attention_length_rates
        widths = (backward and self.attention_backward_head_dim_rates) or self.attention_head_dim_rates
        return _interpolate(lengths, length) * _interpolate(widths, head_dim)

    def with_attention_kernel(self, kernel: str | None, training_source: str) -> HardwareSpec:
        """This accelerator with ``kernel``'s attention rates (:class:`AttentionKernel`) in place of the file's; itself
        for None. ``training_source`` names the training file that asked for it in errors."""
        if kernel is None:
            return self
        known = self.attention_kernels or {}
        if kernel not in known:
            fix = (f"name one of {', '.join(sorted(known))} or leave it out (the file's own rates)" if known else
                   "leave it out (the file's own rates) or give the kernel's rates under attention_kernels in the "
                   "hardware file")
            raise InputError([(training_source, "attention_kernel", kernel), (self.source, "attention_kernels",
                              sorted(known))], "the hardware file has no rates for this attention kernel", fix)
        rates = known[kernel]
        return dataclasses.replace(self, attention_efficiency=rates.efficiency,
                                   attention_length_rates=rates.length_rates,
                                   attention_backward_length_rates=rates.backward_length_rates)

    @property
    def peer_bandwidth(self) -> float:
        return self.intra_node_peer_bandwidth_bytes_per_s or self.intra_node_bandwidth_bytes_per_s

    def group_fabric_bandwidth(self, members: int) -> float:
        """One GPU's bandwidth into the node's fabric for a collective among ``members`` GPUs of one node: the whole
        ``intra_node_bandwidth`` on a switch; on a fully connected mesh the ``members - 1`` links to the other
        members (at least one), up to ``intra_node_bandwidth``. A communicator's rings and all-to-alls run over its own
        GPUs (RCCL relays nothing through a GPU outside it), so only the direct links among the members carry its
        traffic: an all-to-all sends to each peer on its own link, and rings round the group in several orders
        (for 4 GPUs, its six directed orders at half a link each) load each of a GPU's ``members - 1`` links alike. The
        links to GPUs outside the group stay idle. RCCL says so of itself: on 4 MI300X its topology reads
        ``maxBw 48.0 totalBw 144.0``, three links of 48 GB/s (ROCm/rccl issue 1210), and its usage tips
        (ROCm/rccl pull request 1270, docs/how-to/rccl-usage-tips.rst) warn that with fewer than 8 MI300X "one can
        only achieve a fraction of the potential bandwidth on the system"."""
        if self.intra_node_topology == "switch":
            return self.intra_node_bandwidth_bytes_per_s
        return min(self.intra_node_bandwidth_bytes_per_s, max(1, members - 1) * self.peer_bandwidth)


MAX_TILE = 4096
"""Largest GEMM tile side a hardware file may give (real kernels' tiles are 64 to 256 a side)."""
MIN_FRACTION = 1e-3
"""Smallest efficiency or share of a peak a hardware file may give (a kernel at 0.1 % of its peak is no
kernel any run uses; far smaller shares make times that no longer add up)."""
_BYTES_PER_S = (1e6, 1e16, "bytes per second")
_SECONDS = (1e-9, 1.0, "seconds")
SPANS = {
    "peak_bf16_tflops": (1e-3, 1e7, "TFLOP/s"), "peak_fp8_tflops": (1e-3, 1e7, "TFLOP/s"),
    "hbm_bytes": (1e6, 1e16, "bytes"), "runtime_reserved_bytes": (1.0, 1e16, "bytes"),
    "hbm_bandwidth_bytes_per_s": _BYTES_PER_S, "intra_node_bandwidth_bytes_per_s": _BYTES_PER_S,
    "intra_node_peer_bandwidth_bytes_per_s": _BYTES_PER_S, "inter_node_bandwidth_bytes_per_s": _BYTES_PER_S,
    "hybridep_bandwidth_bytes_per_s": _BYTES_PER_S, "deepep_sm_bandwidth_bytes_per_s": _BYTES_PER_S,
    "scatter_add_elements_per_s": (1e3, 1e16, "elements per second"),
    "gemm_half_intensity": (1e-3, 1e6, "FLOP per byte"), "gpus_per_node": (1, 2**16, "GPUs"),
    "compute_units": (1, 2**20, "compute units"), "collective_ctas_per_card": (1, 2**10, "CTAs"),
    **{name: _SECONDS for name in ("intra_node_latency_s", "inter_node_latency_s", "host_op_seconds",
                                   "host_launch_seconds", "moe_sync_host_op_seconds", "moe_kernel_seconds",
                                   "stream_launch_gap_seconds", "hybridep_rank_latency_s")},
}
"""Each physical figure's span: wide enough for a CPU host and any accelerator to come (a benchmark host
at 1 TFLOP/s and 1 GB/s; an HBM at 10 PB/s), narrow enough that a unit slip by orders of magnitude (a
latency of 1e300 s, a bandwidth of 1e-300) is named here rather than surfacing as an unnamed stage time
too large to sum. Zero is left to the checks above (a time of 0 is none; a rate of 0 is refused there)."""


def _check_rates(source: str, name: str, rates: tuple[tuple[float, float], ...], what: str, example: str) -> None:
    """A rate table's pairs are ``[what > 0, relative rate in [MIN_FRACTION, 1.5]]``, each ``what`` once."""
    if any(len(pair) != 2 or not pair[0] > 0 or not MIN_FRACTION <= pair[1] <= 1.5 for pair in rates):
        raise InputError([(source, name, [list(p) for p in rates])],
                         f"each entry is [{what} > 0, relative rate in [{MIN_FRACTION:g}, 1.5]]",
                         f"give pairs such as {example}")
    if len({pair[0] for pair in rates}) < len(rates):
        raise InputError([(source, name, [list(p) for p in rates])],
                         f"gives one {what} twice (the table would take either rate)",
                         f"give each {what} once, e.g. {example}")


def _interpolate(table: tuple[tuple[float, float], ...] | None, at: float | None) -> float:
    """A rate table's value at ``at``: interpolated on a log scale between its pairs, the nearest pair's outside
    them, 1 without the table or the value."""
    if not table or at is None:
        return 1.0
    points = sorted(table)
    x = math.log2(min(max(at, points[0][0]), points[-1][0]))
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= math.log2(x1):
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
    return points[-1][1]


def check_runs_on(training: TrainingSpec, hardware: HardwareSpec) -> None:
    """Raise one :class:`InputError` where ``training`` asks for more of the accelerator than it has: FP8 without
    an FP8 peak, MXFP8 without block-scaled FP8 units, the flex dispatcher's kernels given as many SMs (compute
    units) as the GPU has or more -- DeepEP's bound would price a dispatch on SMs that do not exist (its rate grows
    with them), and overlapped compute would get none. Checked once before any candidate is projected (each
    candidate refused alike was a list of 'not projected' lines and no error). So are an ``attention_kernel`` the
    hardware file has no rates for, and the flex dispatcher over an expert whose tensor-parallel ranks span nodes
    (``expert_tensor_parallel_size`` above ``gpus_per_node``): DeepEP's node count (:func:`~primuspipe.projection.comm.
    token_destinations`) takes each node to hold whole experts, and there a node holds part of one (it divided by
    zero experts per node)."""
    hardware.with_attention_kernel(training.attention_kernel, training.source)
    if training.moe_token_dispatcher_type == "flex" and training.etp > hardware.gpus_per_node:
        raise InputError([(training.source, "expert_tensor_parallel_size", training.etp),
                          (hardware.source, "gpus_per_node", hardware.gpus_per_node)],
                         "the flex dispatcher's sends to an expert split over nodes are not modelled",
                         "use an expert_tensor_parallel_size of at most gpus_per_node, or moe_token_dispatcher_type "
                         "alltoall")
    if training.fp8:
        hardware.fp8_peak_tflops()
    if training.fp8 and training.fp8_recipe == "mxfp8" and not hardware.block_scaled_fp8:
        raise InputError([(training.source, "fp8_recipe", "mxfp8"), (hardware.source, "block_scaled_fp8", False)],
                         "MXFP8 needs matrix units that scale FP8 per block (Blackwell, MI355X)",
                         "use fp8_recipe tensorwise/delayed/blockwise on this accelerator")
    sms, units = training.dispatcher_sms, hardware.compute_units
    if units is not None and sms >= units:
        field = "turbo_deepep_num_cu" if training.use_turbo_deepep else "moe_flex_dispatcher_num_sms"
        raise InputError([(training.source, field, sms), (hardware.source, "compute_units", units)],
                         "the flex dispatcher's kernels would hold every SM, leaving none for the compute",
                         f"give {field} fewer SMs than the GPU has ({units})")


def load_hardware(path: str | Path) -> HardwareSpec:
    """A :class:`HardwareSpec` from a hardware YAML file."""
    return spec_from_mapping(HardwareSpec, read_yaml(path, "hardware"), str(path))
