"""How long one GEMM takes on one accelerator, from its shape.

A GEMM ``C[m, n] = A[m, k] B[k, n]`` (``groups`` identical ones for the experts of a grouped GEMM) is cut
into output tiles of ``gemm_tile`` (rows x columns); the tiles run in waves over the accelerator's
compute units (SMs / CUs), and a wave takes as long as a full one however many of its units have work
(wave quantisation; tiles past the matrix edge compute padding). The groups of a grouped GEMM (the
experts of one rank) run one after another, as Transformer Engine's ``GroupedLinear`` issues them, each
with its own last, partly idle wave. So::

    compute = waves * 2 * tile_m * tile_n * k / (peak * gemm_efficiency / compute_units)
    memory  = (m k + k n) * input bytes + m n * output bytes, at HBM bandwidth
    time    = max(compute, memory)                      (a roofline; Williams et al. 2009)

``gemm_efficiency`` is the best a large, well-shaped GEMM reaches of the peak (the Maximum Achievable
Matmul FLOPS, MAMF, measured per accelerator and precision: the hardware files cite where); the tile
and the unit count are the hardware's. NVIDIA's "Matrix Multiplication Background User's Guide"
describes tile and wave quantisation. Hardware without ``gemm_efficiency`` keeps the shape-free model:
FLOPs at ``peak * achievable_fraction``.

FP8 GEMMs (Transformer Engine) run at the FP8 peak and its own MAMF efficiency, read 1-byte inputs and
write a 2-byte output; MXFP8 ones (block-scaled: an E8M0 scale per 32 elements of K that the tensor cores
apply in the main loop) at ``mxfp8_gemm_efficiency`` where the hardware file gives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from primuspipe.projection.hardware_spec import HardwareSpec


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


def gemm_seconds(gemm: Gemm, hardware: HardwareSpec, precision: str) -> float:
    """Seconds of ``gemm`` on ``hardware`` (``precision``: the training's, for non-FP8 GEMMs)."""
    h = hardware
    slow = 0.5 if precision == "fp32" else 1.0
    peak = (h.fp8_peak_tflops() if gemm.fp8 else h.peak_bf16_tflops * slow) * 1e12
    if h.gemm_efficiency is None:
        return gemm.flops / (peak * h.achievable_fraction)
    efficiency = (h.mxfp8_gemm_efficiency if gemm.mxfp8 and h.mxfp8_gemm_efficiency is not None
                  else h.fp8_gemm_efficiency if gemm.fp8 and h.fp8_gemm_efficiency is not None
                  else h.gemm_efficiency) * h.sustained_fraction
    tile_m, tile_n = h.gemm_tile
    tiles = math.ceil(gemm.m / tile_m) * math.ceil(gemm.n / tile_n)
    units = h.compute_units or tiles  # no unit count: no wave quantisation, only tile padding
    waves = math.ceil(tiles / units - 1e-9) * gemm.groups  # a grouped GEMM runs its groups one after another
    compute = waves * units * 2 * tile_m * tile_n * gemm.k / (peak * efficiency)
    in_bytes = 1 if gemm.fp8 else (4 if precision == "fp32" else 2)
    out_bytes = 4 if precision == "fp32" else 2
    moved = ((gemm.m + gemm.n) * gemm.k * in_bytes + gemm.m * gemm.n * out_bytes) * gemm.groups
    return max(compute, moved / (h.hbm_bandwidth_bytes_per_s * h.memory_bandwidth_fraction))
