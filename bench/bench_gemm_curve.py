"""The GEMM efficiency curve by shape against the published GEMM measurements it is fitted to.

    PYTHONPATH=. python bench/bench_gemm_curve.py [--output bench/results/gemm_curve.json] [--markdown FILE]

For every set of ``examples/projection/hardware/measurements/gemm.yaml`` (one accelerator, one precision, one
public source): the ``gemm_half_intensity`` that least-squares fits it (:mod:`primuspipe.projection.gemm_fit`),
the hardware file's value (the fit over all the file's sets together where it has several), and each measured
GEMM's TFLOP/s against the model's with the flat MAMF and with
the file's curve, with the rms and worst log error of each.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from write_results import markdown_table, run_bench  # noqa: E402

from primuspipe.projection.gemm_fit import by_hardware_file, fit, load_measurements  # noqa: E402


def _spread(errors: list[float]) -> dict[str, float]:
    return {"rms": math.sqrt(sum(e * e for e in errors) / len(errors)), "worst": max(abs(e) for e in errors)}


def produce() -> tuple[dict, str]:
    sets, rows, measurements = [], [], load_measurements()
    pooled = {path: fit(group) for path, group in by_hardware_file(measurements).items()}
    for measured in measurements:
        hardware = measured.hardware
        flat, curve = measured.modelled_tflops(None), measured.modelled_tflops(hardware.gemm_half_intensity)
        precision = "FP8" if measured.fp8 else "BF16"
        sets.append({
            "hardware": hardware.name, "precision": precision, "source": measured.source,
            "fitted_half_intensity": measured.fit(), "file_fit": pooled[hardware.source],
            "file_half_intensity": hardware.gemm_half_intensity,
            "flat": _spread(measured.log_errors(None)),
            "curve": _spread(measured.log_errors(hardware.gemm_half_intensity)),
            "points": [{"m": m, "n": n, "k": k, "groups": measured.groups, "measured_tflops": t,
                        "flat_tflops": f, "curve_tflops": c}
                       for (m, n, k, t), f, c in zip(measured.points, flat, curve)]})
        for (m, n, k, t), f, c in zip(measured.points, flat, curve):
            rows.append([hardware.name, precision, f"{measured.groups} x {m:.0f} x {n:.0f} x {k:.0f}", f"{t:,.1f}",
                         f"{f:,.0f}", f"{c:,.0f}", f"{c / t:.2f}"])
    summary = [f"{s['hardware']} {s['precision']}: fitted {s['fitted_half_intensity']:.1f}, file "
               f"{s['file_half_intensity']} (its sets together: {s['file_fit']:.1f}), rms log error {s['curve']['rms']:.3f} (worst {s['curve']['worst']:.3f}) "
               f"against {s['flat']['rms']:.3f} ({s['flat']['worst']:.3f}) flat; {s['source']}" for s in sets]
    table = markdown_table(["GPU", "precision", "groups x m x n x k", "measured TFLOP/s", "flat MAMF", "curve",
                            "curve / measured"], rows)
    return {"sets": sets}, table + "\n" + "\n".join(summary) + "\n"


if __name__ == "__main__":
    run_bench(__doc__, "gemm_curve", produce)
