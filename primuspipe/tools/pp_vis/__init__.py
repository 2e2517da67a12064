"""pp_vis: draw pipeline timelines from real runs (``dump_pp_data``) and from the simulator, and set a
run beside its simulation.

Everything takes :class:`~primuspipe.io.timeline.Timeline` values (the one format both sides write) and
returns values or writes files; ``primuspipe vis`` and ``primuspipe calibrate`` are the command line.
See docs/pp_vis.md.

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.simulator import CostModel, simulate
>>> cost = CostModel.per_stage(2, f=1, b=1, w=1)
>>> run = simulate(build_schedule("1f1b", pp=2, microbatches=4), cost).timeline()
>>> comparison = compare_timelines(run, replay(run, cost))
>>> [(f.name, f.difference) for f in comparison.figures()][-3:]  # no memory model: bytes unknown
[('bubble rate mean', 0.0), ('peak memory rank 0 (bytes)', None), ('peak memory rank 1 (bytes)', None)]
"""

from importlib import import_module

from primuspipe.calibration.measure import measure_costs
from primuspipe.calibration.measured import MeasuredCosts
from primuspipe.calibration.replay import compute_order, executed_table, placement_of
from primuspipe.tools.pp_vis.load import in_unit, load_iterations, load_timeline
from primuspipe.tools.pp_vis.stats import (
    Comparison,
    Figure,
    OrderDifference,
    TimelineStats,
    compare_timelines,
    replay,
    timeline_stats,
)
from primuspipe.tools.pp_vis.trace import write_trace

__all__ = ["Comparison", "Figure", "MeasuredCosts", "OrderDifference", "TimelineStats", "compare_timelines",
           "compute_order", "draw_png", "executed_table", "in_unit", "load_iterations", "load_timeline",
           "measure_costs", "placement_of", "replay", "timeline_figure", "timeline_stats", "write_html", "write_trace"]

_DRAWING = {"draw_png": "png", "timeline_figure": "html", "write_html": "html"}
"""Loaded on first use: matplotlib and plotly take longer to import than most commands take to run."""


def __getattr__(name: str):
    if name in _DRAWING:
        return getattr(import_module(f"primuspipe.tools.pp_vis.{_DRAWING[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
