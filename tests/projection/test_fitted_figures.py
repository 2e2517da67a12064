"""The few fitted hardware figures stay fitted: each names held-in rows that exist, carries one value across the
hardware files that share it, and sits within a grid step of its least-squares best under the current model
(bench/refit_published.py), so a change to the time model that moves a fit cannot land without its refit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from published_rows import shipped_runs
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.published import EXAMPLES

_SPEC = importlib.util.spec_from_file_location(
    "refit_published", Path(__file__).resolve().parents[2] / "bench" / "refit_published.py")
refit_published = sys.modules["refit_published"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(refit_published)
FIGURES = refit_published.FIGURES


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.field}-{f.hardware[0]}")
def test_a_fitted_figure_names_held_in_rows_and_one_value(figure):
    assert refit_published.fit_rows(figure, shipped_runs()), f"no counted held-in row for {figure.field}"
    values = {getattr(load_hardware(EXAMPLES / "hardware" / f"{h}.yaml"), figure.field) for h in figure.hardware}
    assert len(values) == 1, f"{figure.field} differs across {figure.hardware}: {values}"


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.field}-{f.hardware[0]}")
def test_a_fit_is_at_its_best_value(figure):
    fit = refit_published.refit(figure, shipped_runs())
    assert abs(fit["best_value"] - fit["file_value"]) <= figure.step * 1.001, fit
