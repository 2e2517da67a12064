"""The amounts a pass's time is priced from, and their sums: GEMMs by shape, attention FLOPs, bytes of
memory-bound kernels, MXFP8 casts, FP8 transposes, accumulating scatters.

Every pricing module of the package builds these and adds them up; :class:`Work` alone turns them into seconds
on a hardware spec, so the work side never reads the hardware and the time side (:mod:`.times`) never recounts
the work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from primuspipe.projection.gemm import Gemm, gemm_seconds
from primuspipe.projection.hardware_spec import HardwareSpec


@dataclass(frozen=True)
class Work:
    """What one pass of one part does on one rank."""

    gemms: tuple[Gemm, ...] = ()
    """The pass's GEMMs by shape (timed by :func:`~primuspipe.projection.gemm.gemm_seconds`)."""
    attention_flops: float = 0.0
    dropped_attention_flops: float = 0.0
    """Of ``attention_flops``, those of fused kernels that apply ``attention_dropout`` inside (a Philox draw per
    score), timed at the hardware's ``attention_dropout_rate`` of the plain kernels' rate."""
    memory_bytes: float = 0.0
    """Bytes moved by element-wise (memory-bound) kernels."""
    mxfp8_cast_bytes: float = 0.0
    """Bytes moved by MXFP8 quantize kernels, timed at the hardware's ``mxfp8_cast_bandwidth_fraction``."""
    fp8_transpose_bytes: float = 0.0
    """Bytes per-tensor FP8 casts move for the transposed copies Hopper's FP8 GEMMs need; hardware whose FP8
    GEMMs take any layout (``fp8_gemm_any_layout``) makes none."""
    scatter_add_elements: float = 0.0
    """Elements accumulating scatters (``scatter_add_``, ``index_add_``) add, timed at the hardware's
    ``scatter_add_elements_per_s`` where it gives it, else as the ``scatter_add_bytes`` they move."""
    scatter_add_bytes: float = 0.0
    """Bytes those scatters read and write, their cost as plain copies."""

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops for g in self.gemms)

    def __add__(self, other: Work) -> Work:
        return Work(self.gemms + other.gemms, **{name: getattr(self, name) + getattr(other, name) for name in AMOUNTS})

    def scaled(self, factor: float) -> Work:
        gemms = tuple(g.times(factor) for g in self.gemms)
        return Work(gemms, **{name: getattr(self, name) * factor for name in AMOUNTS})

    def gemm_seconds(self, hardware: HardwareSpec, precision: str) -> float:
        return sum(gemm_seconds(g, hardware, precision) for g in self.gemms)

    def attention_seconds(self, hardware: HardwareSpec, precision: str, length: float | None = None,
                          head_dim: float | None = None, backward: bool = False) -> float:
        """Seconds of the attention kernels; ``length``: the queries one kernel sees, ``head_dim``: its heads'
        query/key width (the rate depends on them where the hardware file gives ``attention_length_rates`` and
        ``attention_head_dim_rates``); ``backward``: the kernels are a backward pass's (at
        ``attention_backward_length_rates`` where the file gives them)."""
        slow = 0.5 if precision == "fp32" else 1.0
        rate = hardware.attention_rate(length, head_dim, backward)
        flops = self.attention_flops + self.dropped_attention_flops * (1 / hardware.attention_dropout_rate - 1)
        return flops / (hardware.peak_bf16_tflops * 1e12 * hardware.attention_fraction * slow * rate)

    def seconds(self, hardware: HardwareSpec, precision: str, length: float | None = None,
                head_dim: float | None = None, backward: bool = False) -> float:
        bytes_per_s = hardware.hbm_bandwidth_bytes_per_s * hardware.memory_bandwidth_fraction
        cast_per_s = hardware.hbm_bandwidth_bytes_per_s * hardware.mxfp8_cast_fraction
        moved = self.memory_bytes + (0.0 if hardware.fp8_gemm_any_layout else self.fp8_transpose_bytes)
        scatter_rate = hardware.scatter_add_elements_per_s
        scatters = (self.scatter_add_elements / scatter_rate if scatter_rate is not None
                    else self.scatter_add_bytes / bytes_per_s)
        return (self.gemm_seconds(hardware, precision)
                + self.attention_seconds(hardware, precision, length, head_dim, backward)
                + moved / bytes_per_s + self.mxfp8_cast_bytes / cast_per_s + scatters)


AMOUNTS = tuple(f.name for f in fields(Work) if f.name != "gemms")
"""The fields of :class:`Work` besides its GEMMs: quantities that add up and scale alike."""


@dataclass(frozen=True)
class PassWork:
    """Forward, input-gradient and weight-gradient work of one part; ``recompute`` is the forward work a
    selective recompute repeats in B (a full recompute repeats all of ``forward``)."""

    forward: Work
    backward_input: Work
    backward_weight: Work
    recompute: Work = Work()

    def passes(self) -> tuple[Work, Work, Work]:
        return self.forward, self.backward_input, self.backward_weight


NO_WORK = PassWork(Work(), Work(), Work())
"""A part that does nothing in any pass (a feature the run does not use)."""


def sum_passes(*works: PassWork) -> PassWork:
    """Pass by pass, the sum of ``works`` (pieces of one part that run one after another)."""
    return PassWork(*(sum((w.passes()[i] for w in works), Work()) for i in range(3)))
