"""Interactive HTML drawing (plotly): the PNG's layout, with every node's name, start, end and duration
on hover, zoom on the time axis, and kinds/chunks toggled from the legend. Receives (posted ->
arrived) are a hidden-by-default legend entry. The file embeds plotly.js, so it opens offline."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Collection, Sequence
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from primuspipe import strict
from primuspipe.documents import output_file
from primuspipe.errors import OutputFileError
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.io.timeline import Timeline
from primuspipe.tools.pp_vis import style

_HOVER = ("%{customdata[0]} on rank %{customdata[4]}<br>start %{customdata[1]:.6g}<br>end %{customdata[2]:.6g}"
          "<br>duration %{customdata[3]:.6g} {unit}<extra>{where}</extra>")


def timeline_figure(timelines: Timeline | Sequence[Timeline], *,
                    marks: Collection[tuple[int, ScheduleNode]] = ()) -> go.Figure:
    """The figure of one timeline, or of several stacked on one shared time axis (one time unit)."""
    panels = style.panels(timelines)
    rows = [max(len(t.ranks), 1) for t in panels]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.12 / len(panels),
                        subplot_titles=[style.title(t) for t in panels], row_heights=rows)
    marks = set(marks)
    shown: set[str] = set()
    for row, timeline in enumerate(panels, 1):
        for trace in _traces(timeline, marks):
            trace.showlegend = trace.legendgroup not in shown
            shown.add(trace.legendgroup)
            fig.add_trace(trace, row=row, col=1)
        labels = [f"rank {r.rank}" for r in sorted(timeline.ranks, key=lambda r: r.rank)]
        fig.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed", row=row, col=1)
    fig.update_xaxes(title_text=f"time ({panels[0].time_unit})", row=len(panels), col=1)
    fig.update_layout(barmode="overlay", height=160 + sum(40 * r + 80 for r in rows), template="plotly_white",
                      legend={"orientation": "h", "y": -0.12 if len(panels) == 1 else -0.06},
                      title={"text": "primuspipe pp_vis", "font": {"size": 14}})
    return fig


@strict.arguments()
def write_html(timelines: Timeline | Sequence[Timeline], path: str | os.PathLike, *,
               marks: Collection[tuple[int, ScheduleNode]] = ()) -> Path:
    """Write :func:`timeline_figure` as one self-contained HTML file."""
    path = output_file(path, "HTML file", writes="HTML")
    figure = timeline_figure(timelines, marks=marks)
    try:
        figure.write_html(path, include_plotlyjs=True, full_html=True)
    except OSError as exc:
        raise OutputFileError(f"cannot write HTML file {path}: {exc.strerror or exc}; give a writable file path") from None
    return path


def _traces(timeline: Timeline, marks: set) -> list[go.Bar]:
    """One bar trace per (kind, chunk), plus one for receives."""
    groups: dict[tuple[NodeKind, int], list] = defaultdict(list)
    waits = []
    for rt in timeline.ranks:
        for e in rt.events:
            entry = (rt.rank, e, (rt.rank, e.node) in marks)
            if e.node.kind.on_host_stream:
                continue  # host copies overlap the compute bars; the PNG draws them as lines
            if e.node.kind.is_compute:
                groups[(e.node.kind, e.node.chunk)].append(entry)
            elif e.node.kind.is_recv:
                waits.append(entry)
    where = "run" if timeline.source == "run" else "simulated"
    hover = _HOVER.replace("{unit}", timeline.time_unit).replace("{where}", where)
    traces = []
    for (kind, chunk), entries in sorted(groups.items(), key=lambda kv: (style.kind_rank(kv[0][0]), kv[0][1])):
        color = style.node_color(kind, chunk, timeline.vpp)
        name = style.kind_name(kind) + (f", chunk {chunk}" if timeline.vpp > 1 else "")
        traces.append(go.Bar(
            **_bars(entries), orientation="h", name=name, legendgroup=name, hovertemplate=hover,
            text=[style.bar_label(e.node) for _, e, _ in entries], textposition="inside", insidetextanchor="middle",
            textfont={"color": style.text_color(color), "size": 10},
            marker={"color": color, "pattern": {"shape": style.plotly_pattern(chunk), "fgcolor": style.kind_color(kind)},
                    "line": {"color": [style.MARK_COLOR if m else "white" for _, _, m in entries],
                             "width": [2.5 if m else 0.5 for _, _, m in entries]}},
        ))
    if waits:
        traces.append(go.Bar(**_bars(waits), orientation="h", name="receive: posted -> arrived",
                             legendgroup="receive", hovertemplate=hover, width=0.15, offset=0.3,
                             marker={"color": style.COMM_COLOR}, opacity=0.5, visible="legendonly"))
    return traces


def _bars(entries: list) -> dict:
    return {
        "base": [e.start for _, e, _ in entries],
        "x": [e.end - e.start for _, e, _ in entries],
        "y": [f"rank {rank}" for rank, _, _ in entries],
        "customdata": [[str(e.node), e.start, e.end, e.end - e.start, rank] for rank, e, _ in entries],
    }
