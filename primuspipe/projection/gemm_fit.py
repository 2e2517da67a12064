"""Fitting a hardware file's GEMM efficiency curve (``gemm_half_intensity``) to measured GEMMs over shapes.

``examples/projection/hardware/measurements/gemm.yaml`` lists published measurements, a set per accelerator and
precision with its source (a URL, or the repository's own measurement: a results file under ``bench/results``).
Each point is modelled exactly as the projection models that GEMM
(:func:`~primuspipe.projection.gemm.gemm_seconds`: the hardware file's tiles, waves, MAMF and roofline; the set's
groups on its kernel path), as an isolated kernel (``sustained_fraction`` 1, which stands for what a whole
training step loses on top); the fit is the ``gemm_half_intensity`` that minimises the squared log error of the
modelled times, so what tiles and waves already explain is not fitted twice. A hardware file measured by more
than one set (the H100: a published cuBLASLt sweep and the training shapes timed on a lent GPU) carries the fit
over all its sets' points together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from primuspipe.projection.gemm import GEMM_STREAMS, GROUPED_GEMM_KERNELS, Gemm, gemm_seconds
from primuspipe.projection.hardware_spec import HardwareSpec, load_hardware
from primuspipe.projection.spec_fields import InputError, read_yaml

MEASUREMENTS = (Path(__file__).resolve().parents[2] / "examples" / "projection" / "hardware"
                / "measurements" / "gemm.yaml")
"""The shipped measurements (beside the hardware files they fit, which name them relative to this file)."""


@dataclass(frozen=True)
class MeasuredGemms:
    """One published set of GEMM measurements on one accelerator in one precision."""

    hardware: HardwareSpec
    fp8: bool
    source: str
    points: tuple[tuple[float, float, float, float], ...]
    """``(m, n, k, TFLOP/s)`` per measured GEMM."""
    groups: int = 1
    kernel: str = "multi_stream"
    streams: int = GEMM_STREAMS

    def modelled_tflops(self, half_intensity: float | None) -> list[float]:
        """The rate the model gives each point's GEMM with ``half_intensity`` (None: the flat MAMF)."""
        hardware = replace(self.hardware, sustained_fraction=1.0, fp8_sustained_fraction=None,
                           gemm_half_intensity=half_intensity)
        return [2 * m * n * k * self.groups / gemm_seconds(self.gemm(m, n, k), hardware, "bf16") / 1e12
                for m, n, k, _ in self.points]

    def gemm(self, m: float, n: float, k: float) -> Gemm:
        return Gemm(m, n, k, groups=self.groups, fp8=self.fp8, kernel=self.kernel, streams=self.streams)

    def log_errors(self, half_intensity: float | None) -> list[float]:
        """``log(measured / modelled)`` rate per point."""
        return [math.log(point[3] / rate) for point, rate in zip(self.points, self.modelled_tflops(half_intensity))]

    def fit(self) -> float:
        """The ``gemm_half_intensity`` of least squared log error over this set alone (:func:`fit`)."""
        return fit([self])


def fit(sets: list[MeasuredGemms]) -> float:
    """The ``gemm_half_intensity`` of least squared log error over every point of ``sets`` (one hardware file's
    sets together: a file carries one constant, so each of its measurements counts once, whatever its set): a
    scan over a log grid, then golden-section refinement around its best (the error is smooth and has one valley
    over the intensities GEMMs have)."""
    def cost(log_x: float) -> float:
        return sum(e * e for s in sets for e in s.log_errors(math.exp(log_x)))

    grid = [math.log(1.0) + i * math.log(1e5) / 200 for i in range(201)]
    best = min(range(len(grid)), key=lambda i: cost(grid[i]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        lo, hi = (lo, b) if cost(a) < cost(b) else (a, hi)
    return math.exp((lo + hi) / 2)


def by_hardware_file(sets: list[MeasuredGemms]) -> dict[str, list[MeasuredGemms]]:
    """``sets`` grouped by the hardware file they fit (its path), in the order the files first appear."""
    files: dict[str, list[MeasuredGemms]] = {}
    for measured in sets:
        files.setdefault(measured.hardware.source, []).append(measured)
    return files


def load_measurements(path: str | Path = MEASUREMENTS) -> list[MeasuredGemms]:
    """The measurement sets of ``path``, each with its hardware file (named relative to ``path``) loaded."""
    path = Path(path)
    sets = read_yaml(path, "GEMM measurements").get("sets") or []
    measured = []
    for i, entry in enumerate(sets):
        where = f"sets[{i}]"
        kernel, precision = entry.get("kernel", "multi_stream"), entry.get("precision")
        if precision not in ("bf16", "fp8") or kernel not in GROUPED_GEMM_KERNELS:
            raise InputError([(str(path), where, {"precision": precision, "kernel": kernel})],
                             "unknown precision or kernel path",
                             f"give precision bf16 or fp8 and kernel one of {', '.join(GROUPED_GEMM_KERNELS)}")
        points = tuple(tuple(float(v) for v in p) for p in entry.get("points") or ())
        if not points or any(len(p) != 4 or not all(math.isfinite(v) and v > 0 for v in p) for p in points):
            raise InputError([(str(path), f"{where}.points", entry.get("points"))],
                             "each point is [m, n, k, TFLOP/s], all positive", "give the measured shapes and rates")
        measured.append(MeasuredGemms(
            hardware=load_hardware(path.parent / entry["hardware"]), fp8=precision == "fp8", source=entry["source"],
            points=points, groups=int(entry.get("groups", 1)), kernel=kernel,
            streams=int(entry.get("streams", GEMM_STREAMS))))
    return measured
