"""How nodes look, shared by the PNG and the HTML drawings: a colour per compute kind, a lighter
shade and a hatch per chunk, and the label written in a bar."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.colors import to_hex, to_rgb

from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.io.timeline import Timeline
from primuspipe.tools.pp_vis.stats import timeline_stats


def kind_color(kind: NodeKind) -> str:
    """The kind's colour in the kind table."""
    return kind.spec.color


def kind_name(kind: NodeKind) -> str:
    """Legend entry: the kind and what it does (``F forward``)."""
    return f"{kind} {kind.spec.label}"


def kind_rank(kind: NodeKind) -> int:
    """Where the kind comes in legends: the kind table's order."""
    return compute_kinds().index(kind)

HATCHES = ("", "//", "..", "xx", "\\\\", "oo")
"""Matplotlib hatch per chunk (chunk 0 plain); plotly gets the same pattern from :func:`plotly_pattern`."""
_PLOTLY_PATTERNS = {"": "", "//": "/", "..": ".", "xx": "x", "\\\\": "\\", "oo": "+"}
COMM_COLOR = "#7f7f7f"
MARK_COLOR = "#d62728"


def node_color(kind: NodeKind, chunk: int, vpp: int) -> str:
    """The kind's colour, mixed with white by up to 50% for later chunks."""
    mix = 0.5 * chunk / (vpp - 1) if vpp > 1 else 0.0
    r, g, b = (c + (1.0 - c) * mix for c in to_rgb(kind_color(kind)))
    return to_hex((r, g, b))


def text_color(background: str) -> str:
    """Black on light bars, white on dark ones."""
    r, g, b = to_rgb(background)
    return "#1a1a1a" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def hatch(chunk: int) -> str:
    return HATCHES[chunk % len(HATCHES)]


def plotly_pattern(chunk: int) -> str:
    return _PLOTLY_PATTERNS[hatch(chunk)]


def bar_label(node: ScheduleNode) -> str:
    """The microbatch number; an FB pair shows both microbatches (``3/5``)."""
    return f"{node.microbatch}/{node.pair[0]}" if node.pair is not None else str(node.microbatch)


def title(timeline: Timeline) -> str:
    """Shape, step time and bubble of a timeline, for a figure's heading."""
    s = timeline_stats(timeline)
    where = "run" if timeline.source == "run" else "simulated"
    return (f"{where}: {timeline.algorithm} pp={timeline.pp} vpp={timeline.vpp} m={timeline.microbatches}"
            f" (iteration {timeline.iteration}) | step {s.step_time:.4g} {timeline.time_unit}"
            f" | bubble max {s.bubble_rate:.1%}, mean {s.bubble_rate_mean:.1%}")


def memory_label(nbytes: int | None) -> str:
    """Peak memory for a row's margin; empty when the simulator did not model bytes (0)."""
    if nbytes is None:
        return "peak n/a"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes else ""


def panels(timelines: Timeline | Sequence[Timeline]) -> list[Timeline]:
    """The timelines to stack on one time axis: at least one, all in one time unit."""
    out = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not out:
        raise TableFormatError("nothing to draw: no timeline given")
    if len({t.time_unit for t in out}) > 1:
        raise TableFormatError(f"timelines in {sorted({t.time_unit for t in out})} cannot share an axis; "
                               "convert them to one unit first (pp_vis.in_unit)")
    return out
