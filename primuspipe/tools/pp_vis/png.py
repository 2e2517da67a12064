"""Static PNG drawing: one panel per timeline (a run above its simulation, on one time axis), one row
per rank, one bar per compute node coloured by kind, later chunks lighter and hatched, the microbatch
written in the bar when it fits, receives as a thin grey line under the row (posted -> arrived), peak
memory at the right of each row. Drawn on matplotlib's Agg canvas directly (no pyplot, no global
backend state, no display needed)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Collection, Sequence
from pathlib import Path

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from primuspipe import strict
from primuspipe.documents import output_file
from primuspipe.errors import OutputFileError
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.io.timeline import Timeline
from primuspipe.tools.pp_vis import style

_WIDTH_IN, _DPI = 16.0, 100
_ROW_IN, _PANEL_EXTRA_IN = 0.42, 0.9
_BAR = 0.8
_CHAR_PX = 6.0  # width of one label character at the label font size


@strict.arguments()
def draw_png(timelines: Timeline | Sequence[Timeline], path: str | os.PathLike, *,
             marks: Collection[tuple[int, ScheduleNode]] = (), show_comm: bool = True) -> Path:
    """Write the drawing of one timeline, or of several stacked on one time axis (they must share a
    time unit; see :func:`~primuspipe.tools.pp_vis.load.in_unit`). ``marks`` are ``(rank, node)`` to
    outline in red (nodes whose order differs between a run and its simulation)."""
    path = output_file(path, "PNG file", writes="PNG")
    panels = style.panels(timelines)
    rows = [max(len(t.ranks), 1) for t in panels]
    height = sum(r * _ROW_IN + _PANEL_EXTRA_IN for r in rows) + 0.6
    fig = Figure(figsize=(_WIDTH_IN, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": rows})
    span = max(max((e.end for r in t.ranks for e in r.events), default=0.0) for t in panels) or 1.0
    kinds: set[tuple[NodeKind, int]] = set()
    for timeline, ax in zip(panels, axes[:, 0]):
        kinds |= _draw_panel(ax, timeline, span, set(marks), show_comm)
    axes[-1, 0].set_xlabel(f"time ({panels[0].time_unit})")
    vpp = max(t.vpp for t in panels)
    handles = []
    for k, c in sorted(kinds, key=lambda kc: (style.kind_rank(kc[0]), kc[1])):
        with rc_context({"hatch.color": style.kind_color(k), "hatch.linewidth": 0.6}):
            handles.append(Patch(facecolor=style.node_color(k, c, vpp), hatch=style.hatch(c), edgecolor="white",
                                 label=style.kind_name(k) + (f", chunk {c}" if vpp > 1 else "")))
    if show_comm:
        handles.append(Patch(facecolor=style.COMM_COLOR, alpha=0.6, label="receive: posted -> arrived"))
    if marks:
        handles.append(Patch(facecolor="none", edgecolor=style.MARK_COLOR, linewidth=1.5,
                             label="order differs (run vs simulated)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise OutputFileError(f"cannot write PNG file {path}: {exc.strerror or exc}; give a writable file path") from None
    return path


def _draw_panel(ax, timeline: Timeline, span: float, marks: set, show_comm: bool) -> set[tuple[NodeKind, int]]:
    """Draw one timeline into ``ax``; returns the (kind, chunk) groups it used, for the legend."""
    ranks = sorted(timeline.ranks, key=lambda r: r.rank)
    groups: dict[tuple[NodeKind, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    marked, waits, copies = [], [], []
    px_per_unit = _WIDTH_IN * _DPI * 0.86 / span
    for y, rt in enumerate(ranks):
        for e in rt.events:
            node, width = e.node, e.end - e.start
            if node.kind.on_host_stream:  # OFFLOAD / RELOAD: a copy beside the compute, a thin line above it
                copies.append([(e.start, y - _BAR / 2 - 0.06), (e.end, y - _BAR / 2 - 0.06)])
                continue
            if not node.kind.is_compute:
                if show_comm and node.kind.is_recv and width > 0:
                    waits.append([(e.start, y + _BAR / 2 + 0.04), (e.end, y + _BAR / 2 + 0.04)])
                continue
            xranges, ys = groups[(node.kind, node.chunk)]
            xranges.append((e.start, width))
            ys.append(y)
            if (rt.rank, node) in marks:
                marked.append((e.start, width, y))
            label = style.bar_label(node)
            if width * px_per_unit >= _CHAR_PX * len(label) + 4:
                color = style.text_color(style.node_color(node.kind, node.chunk, timeline.vpp))
                ax.text(e.start + width / 2, y, label, ha="center", va="center", fontsize=7, color=color,
                        clip_on=True)
    for (kind, chunk), (xranges, ys) in groups.items():
        with rc_context({"hatch.color": style.kind_color(kind), "hatch.linewidth": 0.6}):
            for y in sorted(set(ys)):
                ax.broken_barh([x for x, yy in zip(xranges, ys) if yy == y], (y - _BAR / 2, _BAR),
                               facecolors=style.node_color(kind, chunk, timeline.vpp), edgecolors="white",
                               linewidths=0.4, hatch=style.hatch(chunk))
    for start, width, y in marked:
        ax.broken_barh([(start, width)], (y - _BAR / 2, _BAR), facecolors="none", edgecolors=style.MARK_COLOR,
                       linewidths=1.5, zorder=3)
    if waits:
        ax.add_collection(LineCollection(waits, colors=style.COMM_COLOR, linewidths=1.2, alpha=0.6))
    if copies:
        ax.add_collection(LineCollection(copies, colors=style.kind_color(NodeKind.OFFLOAD), linewidths=1.2))
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)), [f"rank {rt.rank}" for rt in ranks])
    for y, rt in enumerate(ranks):
        ax.text(1.005, y, style.memory_label(rt.peak_memory_bytes), transform=ax.get_yaxis_transform(),
                va="center", fontsize=7, color="#444444")
    ax.set_xlim(0, span * 1.005)
    ax.set_title(style.title(timeline), fontsize=10, loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    return set(groups)
