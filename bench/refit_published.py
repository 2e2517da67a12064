"""The projection's fitted hardware figures, refitted on their rows under the current model.

    PYTHONPATH=. python bench/refit_published.py [--output bench/results/refit.json]

A few figures in ``examples/projection/hardware/`` are fitted, not published: each was chosen so that named
held-in rows of ``bench/data/published_runs.yaml`` come out right (their files say which). A fit is only
valid for the model it was made under, so after a change to the time model this script searches each
figure again -- least squared log ratio of projected over published tokens/s on the figure's rows, on a grid
around the file's value, the other fitted figures at their file values -- and prints file value, best value
and the rows' ratios at both. It changes no file: a moved figure is edited by hand, with its new value's
reason, in its hardware file. Held-out rows are never used.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from primuspipe.projection import published
from primuspipe.projection.hardware_spec import HardwareSpec, load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.published import PublishedRun, load_runs, project_run


@dataclass(frozen=True)
class FittedFigure:
    """One fitted hardware field and the held-in rows it was fitted on."""

    field: str
    hardware: tuple[str, ...]
    """Hardware files (stems) that carry the figure: one fit serves them all."""
    rows: Callable[[PublishedRun], bool]
    """Which held-in rows the fit reads."""
    step: float
    """Grid step; the grid spans 8 steps either side of the file's value."""


QWEN3_MOE_ROW = "mbridge2509-qwen3-30b-a3b-fp8-16"


@functools.cache
def _dense(model: str) -> bool:
    return not load_model(published.EXAMPLES / "models" / f"{model}.yaml").num_experts


FIGURES = (
    # dense rows only: an MoE row's costs beyond its GEMMs (routing, dispatch, small kernels) are what
    # moe_kernel_seconds and the MoE modelling answer for, not the share of GEMM rate a step sustains
    FittedFigure("sustained_fraction", ("h100", "h200", "h100-hbm2e"), lambda r: r.hardware == "h100" and _dense(r.model), 0.005),
    FittedFigure("moe_kernel_seconds", ("h100", "h200", "h100-hbm2e", "b200", "gb200", "gb300"),
                 lambda r: r.id == QWEN3_MOE_ROW, 0.5e-6),
    FittedFigure("sustained_fraction", ("mi300x", "mi325x"),
                 lambda r: r.id == "amd-pytorch-train-mi300x-llama3.1-8b-bf16-fsdp-8", 0.005),
    FittedFigure("moe_sync_host_op_seconds", ("mi355x",),
                 lambda r: r.id == "primus-mi355x-deepseek-v2-lite-bf16-8-mbs1-baseline", 2e-6),
    FittedFigure("deepep_sm_bandwidth_bytes_per_s", ("mi355x",),
                 lambda r: r.id == "primus-mi355x-deepseek-v2-lite-bf16-8-mbs12-deepep", 0.02e9),
)


def _ratios(rows: list[PublishedRun], figure: FittedFigure, value: float) -> dict[str, float]:
    """Each row's projected/published ratio with ``figure`` set to ``value`` in its hardware files."""
    def load(path, *args, **kwargs) -> HardwareSpec:
        spec = load_hardware(path, *args, **kwargs)
        stem = getattr(path, "stem", str(path).rsplit("/", 1)[-1].removesuffix(".yaml"))
        return dataclasses.replace(spec, **{figure.field: value}) if stem in figure.hardware else spec

    original = published.load_hardware
    published.load_hardware = load
    try:
        return {r.id: project_run(r)["ratio"] for r in rows}
    finally:
        published.load_hardware = original


def _loss(ratios: dict[str, float]) -> float:
    return sum(math.log(x) ** 2 for x in ratios.values())


def fit_rows(figure: FittedFigure, runs: list[PublishedRun]) -> list[PublishedRun]:
    """The counted held-in rows ``figure`` is fitted on."""
    return [r for r in runs if not r.held_out and not r.excluded and not r.lower_bound and figure.rows(r)]


def refit(figure: FittedFigure, runs: list[PublishedRun]) -> dict:
    rows = fit_rows(figure, runs)
    assert rows, figure
    current = getattr(load_hardware(published.EXAMPLES / "hardware" / f"{figure.hardware[0]}.yaml"), figure.field)
    grid = [current + k * figure.step for k in range(-8, 9) if current + k * figure.step > 0]
    ratios = {v: _ratios(rows, figure, v) for v in grid}  # the file's value is the grid's middle point
    losses = {v: _loss(r) for v, r in ratios.items()}
    best = min(losses, key=losses.get)
    return {"field": figure.field, "hardware": list(figure.hardware), "file_value": current, "best_value": best,
            "rows": {"at_file_value": ratios[current], "at_best_value": ratios[best]},
            "at_grid_edge": best in (grid[0], grid[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", help="also write the fits as JSON here")
    args = parser.parse_args()
    runs = load_runs()
    fits = []
    for figure in FIGURES:
        fit = refit(figure, runs)
        fits.append(fit)
        edge = "  (best at the grid's edge: widen it)" if fit["at_grid_edge"] else ""
        print(f"{fit['field']} [{', '.join(fit['hardware'])}]: file {fit['file_value']:.4g}, "
              f"best {fit['best_value']:.4g}{edge}")
        for row, before in fit["rows"]["at_file_value"].items():
            print(f"    {row}: {before:.3f} -> {fit['rows']['at_best_value'][row]:.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(fits, f, indent=1)


if __name__ == "__main__":
    main()
