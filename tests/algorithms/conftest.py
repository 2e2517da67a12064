"""Shared checks for the zero-bubble family tests (grid sweep, CLI figures),
given to the tests as fixtures."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from grid_tables import kept_table
from primuspipe.cli import main
from primuspipe.errors import ScheduleShapeError
from primuspipe.algorithms.build import build_schedule


def _sweep_grid(algorithm: str, **options) -> tuple[int, int, list]:
    """Build every shape pp 1..8 x m 1..3pp+1; returns (built, refused, tables). Plain builds (no options) are kept
    for the every-algorithm grid, which builds the same shapes (:mod:`grid_tables`)."""
    built, refused, tables = 0, 0, []
    for pp in range(1, 9):
        for m in range(1, 3 * pp + 2):
            try:
                tables.append(build_schedule(algorithm, pp, m, **options) if options else kept_table(algorithm, pp, m))
                built += 1
            except ScheduleShapeError as exc:
                assert algorithm in str(exc)
                refused += 1
    return built, refused, tables


def _cli_figures(algorithm: str, pp: int = 8, microbatches: int = 32) -> dict:
    """``primuspipe simulate --json`` for one algorithm, F = B = W = 1, free P2P."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["simulate", "--algorithm", algorithm, "--pp", str(pp), "-m", str(microbatches),
                       "--f", "1", "--b", "1", "--w", "1", "--json"])
    assert status == 0
    (row,) = json.loads(out.getvalue())["results"]
    return row


@pytest.fixture
def sweep_grid():
    return _sweep_grid


@pytest.fixture
def cli_figures():
    return _cli_figures
