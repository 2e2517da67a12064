"""GEMMs with fewer rows than one output tile -- a few tokens per expert, or an average below one row under a
capacity factor or load imbalance. Their intensity ``I`` (near ``m``) was taken from their few rows although the
tile computes all of its rows anyway (already priced as padding), so the shape fraction ``I / (I + h)``
counted the padding twice: 0.8 rows cost 84 ms where 128 rows cost 0.14 ms on H100, and fewer rows cost more.
Each generated shape (every hardware file, grouped and not, each kernel path, BF16 and FP8, the forward,
input-gradient and weight-gradient GEMMs) must price finitely and never cheaper with more rows, up to a tile."""

import functools
import math
from pathlib import Path

import pytest

from hostile_support import record
from primuspipe.projection.gemm import GROUPED_GEMM_KERNELS, Gemm, gemm_seconds, library_tile
from primuspipe.projection.hardware_spec import load_hardware

HARDWARE = sorted((Path(__file__).parents[2] / "examples" / "projection" / "hardware").glob("*.yaml"))
ROWS = [1e-6, 1e-3, 0.01, 0.1, 0.25, 0.5, 0.8, 0.99, 1, 1.5, 2, 3, 7.9, 16, 31, 64, 100, 127]
SHAPES = [(4096, 4096), (1536, 7168), (14336, 4096), (192, 768)]


@functools.cache
def _hardware(path: Path):
    """A hardware file, read once for all of its cases here (the spec is frozen) rather than once a case."""
    return load_hardware(path)


@pytest.mark.parametrize("hardware", HARDWARE, ids=lambda p: p.stem)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("groups, kernel", [(1, "multi_stream")] + [(g, k) for g in (8, 64) for k in GROUPED_GEMM_KERNELS])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("part", ["forward", "dgrad", "wgrad"])
def test_fewer_rows_than_a_tile_price_sanely_and_monotonically(hardware, n, k, groups, kernel, fp8, part):
    h = _hardware(hardware)
    if fp8 and h.fp8_peak_tflops() is None:
        return
    case = f"gemm {hardware.stem} n={n} k={k} groups={groups} {kernel} fp8={fp8} {part}"

    def seconds(m: float) -> float:
        gemm = Gemm(m, n, k, groups=groups, fp8=fp8, kernel=kernel)
        return gemm_seconds(getattr(gemm, part)() if part != "forward" else gemm, h, "bf16")

    tile = library_tile(Gemm(max(ROWS), n, k, groups=groups), h)[0]
    rows = [m for m in ROWS if m <= tile] + [float(tile)]
    times = [seconds(m) for m in rows]
    ok = all(math.isfinite(t) and t > 0 for t in times) and all(
        later >= earlier * (1 - 1e-12) for earlier, later in zip(times, times[1:]))
    record("sound" if ok else "silent", case)
    assert ok, f"{case}: seconds by rows {dict(zip(rows, times))}"
