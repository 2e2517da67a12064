"""Perfetto / Chrome trace of any timeline: the simulator's exporter, given the placement a run's
timeline does not record."""

from __future__ import annotations

import os
from pathlib import Path

from primuspipe import strict
from primuspipe.ir.placement import Placement
from primuspipe.calibration.replay import placement_of
from primuspipe.simulator.trace import write_chrome_trace
from primuspipe.io.timeline import Timeline


@strict.arguments()
def write_trace(timeline: Timeline, path: str | os.PathLike, placement: Placement | None = None) -> Path:
    """Write the trace (open it at https://ui.perfetto.dev); the placement defaults to
    :func:`~primuspipe.calibration.replay.placement_of` the timeline."""
    return write_chrome_trace(path, timeline, placement or placement_of(timeline))
