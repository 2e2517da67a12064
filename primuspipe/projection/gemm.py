"""How long one GEMM takes on one accelerator, from its shape.

A GEMM ``C[m, n] = A[m, k] B[k, n]`` (``groups`` identical ones for the experts of a grouped GEMM) is cut
into output tiles of ``gemm_tile`` (rows x columns); the tiles run in waves over the accelerator's
compute units (SMs / CUs), and a wave takes as long as a full one however many of its units have work
(wave quantisation; tiles past the matrix edge compute padding). How the groups of a grouped GEMM (the
experts of one rank) share waves depends on the kernel path that runs them (:data:`GROUPED_GEMM_KERNELS`,
the training's ``moe_expert_gemm``; :func:`grouped_waves`). So::

    compute = waves * 2 * tile_m * tile_n * k / (peak * gemm_efficiency * shape_fraction / compute_units)
    memory  = (m k + k n) * input bytes + m n * output bytes, at HBM bandwidth
    time    = max(compute, memory)                      (a roofline; Williams et al. 2009)

``gemm_efficiency`` is the best a large, well-shaped GEMM reaches of the peak (the Maximum Achievable
Matmul FLOPS, MAMF, measured per accelerator and precision: the hardware files cite where); the tile
and the unit count are the hardware's. Smaller shapes run further below it: the efficiency is scaled by
:func:`shape_fraction`, ``I / (I + gemm_half_intensity)`` of the GEMM's arithmetic intensity ``I = m n k /
(m k + k n + m n)`` (multiply-adds per element read or written: a tile sequence that reuses each operand
element fewer times spends more of its time loading, filling and draining its pipeline), with
``gemm_half_intensity`` fitted per accelerator to measured GEMMs over shapes
(:mod:`~primuspipe.projection.gemm_fit`; the measurements and their sources are
``examples/projection/hardware/measurements/gemm.yaml``). The fit is of what the model leaves: each measured
point is modelled with the same tiles and waves, so wave quantisation is not counted twice. Where the hardware
file gives ``gemm_min_tile`` (the AMD files: hipBLASLt picks smaller kernels for shapes that would leave units
idle), each GEMM takes the tile :func:`library_tile` chooses. NVIDIA's
"Matrix Multiplication Background User's Guide"
describes tile and wave quantisation. Hardware without ``gemm_efficiency`` keeps the shape-free model:
FLOPs at ``peak * achievable_fraction``.

FP8 GEMMs (Transformer Engine) run at the FP8 peak and its own MAMF efficiency, read 1-byte inputs and
write a 2-byte output; MXFP8 ones (block-scaled: an E8M0 scale per 32 elements of K that the tensor cores
apply in the main loop) at ``mxfp8_gemm_efficiency`` where the hardware file gives it.

Grouped GEMM kernel paths, from the frameworks' source:

* ``multi_stream``: one GEMM per group, issued round-robin on ``GEMM_STREAMS`` (4) side streams, so up to
  four groups run at once and fill each other's idle units. Transformer Engine's ``GroupedLinear`` (what
  megatron-core's ``TEGroupedMLP`` builds) calls ``general_grouped_gemm`` ->
  ``te_general_grouped_gemm`` -> ``nvte_multi_tensor_gemm``, which takes ``multi_stream_cublas_gemm``
  (transformer_engine/common/gemm/cublaslt_gemm.cu: ``get_compute_stream(i % num_streams)``) with
  ``get_num_compute_streams()`` a constant 4 (transformer_engine/common/util/multi_stream.cpp;
  https://github.com/NVIDIA/TransformerEngine, v2.7 to v2.18 alike, the TE 2.x of the NeMo 25.09 / 25.11 /
  26.02 containers). The CUTLASS grouped kernel there is opt-in (``NVTE_USE_CUTLASS_GROUPED_GEMM``, Hopper,
  BF16; v2.8+), and so is the fused cuBLASLt grouped GEMM (``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM``,
  v2.17+, transformer_engine/pytorch/module/grouped_linear.py). megatron-core's legacy ``GroupedMLP``
  (``--moe-use-legacy-grouped-gemm``) calls the ``grouped_gemm`` package's ``gmm``, which also loops
  cuBLAS over ``NUM_STREAM`` 4 streams except for the forward on SM80 (csrc/grouped_gemm.cu,
  https://github.com/fanshiqing/grouped_gemm, ``CublasGroupedGemm``; NeMo AutoModel's MoE experts call the same
  ``ops.gmm``, nemo_automodel/components/moe/layers.py). ROCm's Transformer Engine keeps the same loop
  (transformer_engine/common/gemm/cublaslt_gemm.cu, ``num_streams = 4`` in common/include/transformer_engine/gemm.h,
  https://github.com/ROCm/TransformerEngine), so does the ROCm build of ``grouped_gemm`` that Primus's containers
  install (https://github.com/caaatch22/grouped_gemm, branch ``rocm`` at 8a9b438, pinned by AMD-AGI/Primus's
  .github/workflows/docker-release/Dockerfile.primus-v26.5.1 and docs/01-getting-started/bare-metal-installation.md:
  ``CublasGroupedGemm`` and ``CublasGroupedGemmVariableK`` issue one hipified ``cublasGemmEx`` per expert on
  ``NUM_STREAM`` 4 streams, the group sizes read on the host; its ``hipblaslt`` branch, not the one installed, also
  calls ``hipMalloc`` and hipBLASLt's heuristic query for every expert's GEMM), and Primus-Turbo's hipBLASLt
  backend keeps four (``kMaxNumStreams``,
  csrc/kernels/grouped_gemm/hipblaslt_grouped_gemm.cu, https://github.com/AMD-AGI/Primus-Turbo). On ROCm
  HIP gives a device's streams at most ``GPU_MAX_HW_QUEUES`` hardware queues (ROCm/clr
  rocclr/utils/flags.hpp, "The maximum number of HW queues allocated per device", default 4; the training's
  ``gpu_max_hw_queues``), and a stream created past it reuses the least-used queue of its priority
  (rocclr/device/rocm/rocdevice.cpp, ``Device::acquireQueue``; https://github.com/ROCm/clr); taken as: at
  most that many groups overlap (a shared queue issues its kernels in order).
* ``fused``: one kernel for all groups whose workgroups walk the tiles of every group: the tiles of all
  groups pack into waves, only the last wave of the whole GEMM partly idle. Primus-Turbo's CK grouped GEMM
  (Primus ``--use_turbo_grouped_gemm``) launches a persistent kernel of at most ``num_cu`` workgroups
  (csrc/kernels/grouped_gemm/ck/ck_grouped_gemm_kernel_template.h, ``PersistentTileGemmUniversalTraits``);
  CUTLASS and cuBLASLt grouped GEMMs (the opt-ins above) schedule their tiles the same way.
* ``sequential``: one group after another on one stream, each with its own last partly idle wave:
  megatron-core's ``SequentialMLP`` (experts without ``--moe-grouped-gemm``, a loop over per-expert linears,
  megatron/core/transformer/moe/experts.py, https://github.com/NVIDIA/Megatron-LM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from primuspipe.projection.hardware_spec import HardwareSpec

GROUPED_GEMM_KERNELS = ("multi_stream", "fused", "sequential")
"""How a grouped GEMM's groups run (module docstring)."""
GEMM_STREAMS = 4
"""Side streams the multi-stream path spreads a grouped GEMM's groups over (Transformer Engine's
``get_num_compute_streams()``, the grouped_gemm package's and Primus-Turbo's ``NUM_STREAM``: all 4)."""


@dataclass(frozen=True)
class Gemm:
    """One GEMM (or ``groups`` identical ones) of one pass."""

    m: float
    """Output rows (tokens, for a forward GEMM)."""
    n: float
    """Output columns."""
    k: float
    """Inner (reduced) dimension."""
    groups: float = 1
    """Identical GEMMs run as one grouped GEMM (experts on one rank)."""
    fp8: bool = False
    mxfp8: bool = False
    """An FP8 GEMM whose operands are MXFP8 (block-scaled)."""
    kernel: str = "multi_stream"
    """How the groups run (one of :data:`GROUPED_GEMM_KERNELS`); no matter for one group."""
    streams: int = GEMM_STREAMS
    """``multi_stream``: groups that run at once (``GEMM_STREAMS``, or fewer hardware queues on ROCm)."""
    stretch: float = 1.0
    """Time factor for work beyond the shape: the busiest rank's random excess of token copies under forced
    balance (:attr:`~primuspipe.projection.training_spec.RankShape.load_imbalance`). It lands on the experts
    unevenly, a few copies here and there, so it lengthens the grouped GEMM by its share rather than growing every
    expert's ``m`` (which would tip every group's tile count at once); the FLOPs stay the shape's."""

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.groups

    def dgrad(self) -> Gemm:
        """The input gradient: ``dA[m, k] = dC[m, n] B^T``."""
        return replace(self, n=self.k, k=self.n)

    def wgrad(self) -> Gemm:
        """The weight gradient: ``dB[k, n] = A^T dC``, reducing over the rows."""
        return replace(self, m=self.k, k=self.m)

    def times(self, factor: float) -> Gemm:
        return replace(self, groups=self.groups * factor)


def grouped_waves(tiles: int, units: int, groups: float, kernel: str, streams: int = GEMM_STREAMS) -> float:
    """Waves of ``groups`` GEMMs of ``tiles`` output tiles each over ``units`` compute units on path ``kernel``.

    ``fused`` packs every group's tiles into one sequence of waves; ``multi_stream`` runs the groups in rounds
    of ``streams`` concurrent GEMMs whose tiles share waves (the block scheduler fills units a GEMM leaves
    idle with another stream's tiles), a last short round for the rest; ``sequential`` is rounds of one.
    A fractional group count (a scaled work item) counts its fraction of a group's tiles."""
    def waves(n: float) -> int:
        return math.ceil(n * tiles / units - 1e-9)

    if kernel == "fused":
        return waves(groups)
    concurrent = streams if kernel == "multi_stream" else 1
    rounds, rest = divmod(groups, concurrent)
    return rounds * waves(concurrent) + waves(rest)


def library_tile(gemm: Gemm, hardware: HardwareSpec) -> tuple[int, int]:
    """The output tile one of ``gemm``'s GEMMs runs with: ``gemm_tile``, or where the hardware file gives
    ``gemm_min_tile``, whichever of ``gemm_tile`` and its halvings (per side, down to ``gemm_min_tile``) leaves the
    fewest idle unit-tile slots over its waves (the larger tile on a tie): the library's kernel choice for one GEMM
    (concurrent groups do not enter it)."""
    largest = hardware.gemm_tile
    if hardware.gemm_min_tile is None:
        return largest[0], largest[1]

    def sides(size: int, floor: int) -> list[int]:
        return [size >> i for i in range(8) if size >> i >= floor]

    def slots(tile: tuple[int, int]) -> float:
        tiles = math.ceil(gemm.m / tile[0]) * math.ceil(gemm.n / tile[1])
        units = hardware.compute_units or tiles
        return math.ceil(tiles / units - 1e-9) * units * tile[0] * tile[1]

    candidates = [(a, b) for a in sides(largest[0], hardware.gemm_min_tile[0])
                  for b in sides(largest[1], hardware.gemm_min_tile[1])]
    return min(candidates, key=lambda tile: (slots(tile), -tile[0] * tile[1]))


def shape_fraction(gemm: Gemm, hardware: HardwareSpec, tile_rows: float = 1.0) -> float:
    """The share of the accelerator's GEMM efficiency (its MAMF) one GEMM of ``gemm``'s shape reaches:
    ``I / (I + gemm_half_intensity)`` with ``I = m n k / (m k + k n + m n)``, 1 without ``gemm_half_intensity``.
    The same in every precision: FP8 moves half the bytes per element at twice the rate, so a shape keeps
    its units as busy against its operand traffic in either.

    ``m`` counts at least ``tile_rows`` (the output tile's rows): a GEMM with fewer rows than one tile (a few
    tokens per expert; an average below one row under a capacity factor or load imbalance) still computes the
    whole tile, which :func:`gemm_seconds` already prices as padding; taking its intensity from its few rows
    as well counted the padding twice -- ``I`` near ``m``, so 0.8 rows cost 170 times a 128-row GEMM on H100
    (84 ms) and fewer rows cost more. Every measured GEMM the curve is fitted to has ``m`` of a tile or more."""
    if hardware.gemm_half_intensity is None:
        return 1.0
    m, n, k = max(gemm.m, tile_rows), gemm.n, gemm.k
    intensity = m * n * k / (m * k + k * n + m * n)
    return intensity / (intensity + hardware.gemm_half_intensity)


def gemm_seconds(gemm: Gemm, hardware: HardwareSpec, precision: str) -> float:
    """Seconds of ``gemm`` on ``hardware`` (``precision``: the training's, for non-FP8 GEMMs)."""
    h = hardware
    slow = 0.5 if precision == "fp32" else 1.0
    peak = (h.fp8_peak_tflops() if gemm.fp8 else h.peak_bf16_tflops * slow) * 1e12
    if h.gemm_efficiency is None:
        return gemm.flops / (peak * h.achievable_fraction)
    tile_m, tile_n = library_tile(gemm, h)
    efficiency = (h.mxfp8_gemm_efficiency if gemm.mxfp8 and h.mxfp8_gemm_efficiency is not None
                  else h.fp8_gemm_efficiency if gemm.fp8 and h.fp8_gemm_efficiency is not None
                  else h.gemm_efficiency) * shape_fraction(gemm, h, tile_m) * (
        h.fp8_sustained_fraction if gemm.fp8 and h.fp8_sustained_fraction is not None else h.sustained_fraction)
    tiles = math.ceil(gemm.m / tile_m) * math.ceil(gemm.n / tile_n)
    units = h.compute_units or tiles  # no unit count: no wave quantisation, only tile padding
    waves = grouped_waves(tiles, units, gemm.groups, gemm.kernel, gemm.streams)
    compute = waves * units * 2 * tile_m * tile_n * gemm.k / (peak * efficiency)
    in_bytes = 1 if gemm.fp8 else (4 if precision == "fp32" else 2)
    out_bytes = 4 if precision == "fp32" else 2
    moved = ((gemm.m + gemm.n) * gemm.k * in_bytes + gemm.m * gemm.n * out_bytes) * gemm.groups
    return max(compute, moved / (h.hbm_bandwidth_bytes_per_s * h.memory_bandwidth_fraction)) * gemm.stretch
