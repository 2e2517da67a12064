"""Seconds from work: each part's passes timed on one hardware spec and scaled by a :class:`Calibration` (measured
over analytical time, per part and pass), with the MoE layer's small-kernel overheads, the host's issue time and
Adam's step.

Apart from the work side (:mod:`.work_model`) so the same counted work is timed on any hardware file or
calibration without being recounted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from primuspipe.projection.compute.work import PassWork
from primuspipe.projection.compute.work_model import WorkModel
from primuspipe.projection.hardware_spec import HardwareSpec, check_runs_on
from primuspipe.projection.host import host_priced, layer_host, moe_small_kernels, moe_stream_kernels

PASSES = ("forward", "backward_input", "backward_weight")
PARTS = ("dense", "moe", "embedding", "head", "mtp")
"""The parts the model is timed in: a layer of each kind, the first stage's extra, the last's, and one
multi-token-prediction module (with ``mtp_num_layers``; on the last stage)."""


@dataclass(frozen=True)
class PartTimes:
    """Seconds of each pass of one part, and what its selective recompute adds to B."""

    forward: float
    backward_input: float
    backward_weight: float
    recompute: float = 0.0
    gemm: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of each pass, the seconds of GEMMs (what TP communication can hide under)."""
    attention: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of each pass, the seconds of the attention kernels (what ring attention hides its transfers under)."""
    host: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of each pass, the host's seconds issuing it (:mod:`~primuspipe.projection.host`; 0 where not modelled)."""
    host_syncs: bool = False
    """The forward waits for the GPU once (a device-to-host copy of token counts)."""


@dataclass(frozen=True)
class Calibration:
    """Measured / analytical time factors per part and pass; a missing entry is 1 (no correction)."""

    factors: dict[tuple[str, str], float] = field(default_factory=dict)
    """``(part, pass) -> factor``; part is one of :data:`PARTS`, pass one of :data:`PASSES`."""
    source: str = "analytical"
    """What the factors were measured from (shown in reports)."""

    def factor(self, part: str, pass_name: str) -> float:
        return self.factors.get((part, pass_name), 1.0)


def part_times(work: WorkModel, hardware: HardwareSpec, calibration: Calibration) -> dict[str, PartTimes]:
    """Seconds per pass of every part the model has, analytical times scaled by the calibration."""
    precision = work.training.precision
    hardware = hardware.with_attention_kernel(work.training.attention_kernel, work.training.source)
    check_runs_on(work.training, hardware)
    parts = [p for p in PARTS if p in work.model.layer_kinds or p in ("embedding", "head")
             or (p == "mtp" and work.training.mtp_num_layers)]

    length = work.model.seq_length / work.training.cp  # queries per attention kernel (per ring step under CP)
    head_dim = work.head_dims[0]

    def timed(pw: PassWork, part: str, fp8: bool | None = None) -> PartTimes:
        factors = [calibration.factor(part, name) for name in PASSES]
        fixed = [0.0 if (part, name) in calibration.factors else k  # a measured factor includes them
                 for name, k in zip(PASSES, kernel_overheads(work, hardware, part, fp8))]
        seconds = [w.seconds(hardware, precision, length, head_dim, name != "forward") * f + k
                   for w, f, k, name in zip(pw.passes(), factors, fixed, PASSES)]
        recompute = (pw.recompute.seconds(hardware, precision, length, head_dim) * calibration.factor(part, "forward")
                     + (fixed[0] if part == "moe" and work.training.recomputes("moe") else 0.0))
        gemm = tuple(w.gemm_seconds(hardware, precision) * f for w, f in zip(pw.passes(), factors))
        attention = tuple(w.attention_seconds(hardware, precision, length, head_dim, name != "forward") * f
                          for w, f, name in zip(pw.passes(), factors, PASSES))
        if part not in ("dense", "moe") or not host_priced(hardware, work.training, part):
            return PartTimes(*seconds, recompute, gemm, attention)
        host = layer_host(work.model, work.training, part, fp8)
        return PartTimes(*seconds, recompute, gemm, attention, host.seconds(hardware), host.syncs)

    times = {part: timed(work.part(part), part) for part in parts}
    bf16 = work.training.bf16_layers(work.model.num_layers)
    if bf16:
        plain = WorkModel(work.model, work.training.without_fp8())
        for kind in {work.model.layer_kinds[i] for i in bf16}:
            times[layer_part(kind, True)] = timed(plain.layer(kind), kind, fp8=False)
    return times


def kernel_overheads(work: WorkModel, hardware: HardwareSpec, part: str, fp8: bool | None = None
                     ) -> tuple[float, float, float]:
    """Seconds an MoE layer's small kernels add to each pass beyond their modelled work
    (``moe_kernel_seconds`` per kernel of :func:`~primuspipe.projection.host.moe_small_kernels`, and
    ``stream_launch_gap_seconds`` more per kernel the host launches into a stream rather than a CUDA graph
    replays, :func:`~primuspipe.projection.host.moe_stream_kernels`); nothing for other parts or where the
    hardware file does not give ``moe_kernel_seconds``. A pass with a measured calibration factor does not add
    them: the measurement already holds them."""
    if part != "moe" or hardware.moe_kernel_seconds is None:
        return 0.0, 0.0, 0.0
    kernels = moe_small_kernels(work.model, work.training, fp8)
    streamed = moe_stream_kernels(work.model, work.training, fp8)
    gap = hardware.stream_launch_gap_seconds or 0.0
    return tuple(n * hardware.moe_kernel_seconds + s * gap for n, s in zip(kernels, streamed))  # type: ignore[return-value]


def layer_part(kind: str, bf16: bool) -> str:
    """The :func:`part_times` entry of a layer of ``kind``: its own, or its BF16 twin for a layer that
    ``first_last_layers_bf16`` keeps out of FP8."""
    return f"{kind}:bf16" if bf16 else kind


def optimizer_seconds(local_params: float, hardware: HardwareSpec, bytes_per_param: float) -> float:
    """Adam's step over the parameters a rank updates: memory-bound, ``bytes_per_param`` read and written for
    each (:func:`~primuspipe.projection.static_memory.optimizer_step_bytes`: 30 in mixed precision, the fp32
    gradient, master weight and two moments read, the last three and the bf16 weight written)."""
    return local_params * bytes_per_param / (hardware.hbm_bandwidth_bytes_per_s * hardware.memory_bandwidth_fraction)
