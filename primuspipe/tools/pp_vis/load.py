"""What pp_vis reads: a timeline JSON file (``primuspipe simulate -o DIR`` writes them), a run's dump
directory (``dump_pp_data``: ``<dump_dir>/iter_<n>/rank_<r>.json``), both in the one timeline format, or
a Primus dump folder (its runs' ``dump_pp_data`` or its simulator's output: ``config.json`` and
``pp_rank_<r>.json``, :mod:`primuspipe.tools.pp_vis.primus_dump`)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from primuspipe.errors import TableFormatError
from primuspipe.ir.cost_model import TIME_UNITS
from primuspipe.ir.timeline import TimedNode, Timeline, dump_iterations, dump_path, merge_rank_dumps
from primuspipe.tools.pp_vis.primus_dump import (
    is_primus_dump,
    load_primus_dump,
    load_primus_iterations,
    primus_dumps_under,
)

_WHAT = ("a timeline JSON file (from 'primuspipe simulate -o DIR'), a dump directory holding "
         "iter_<n>/rank_<r>.json (from a run with dump_pp_data, e.g. examples/train_gpt.py --dump-dir DIR), nor a "
         "Primus dump folder holding config.json and pp_rank_<r>.json")


def load_timeline(path: str | os.PathLike, iteration: int | None = None) -> Timeline:
    """One timeline from a file, or from a dump directory (all ranks of ``iteration`` merged on one
    time axis; by default the last dumped iteration, the warmest). A folder ``iter_<n>`` itself, or a
    folder holding exactly one ``*.timeline.json``, works too."""
    path = Path(path)
    if path.is_file():
        if iteration is not None:
            raise TableFormatError(f"{path} is one timeline file; an iteration can only be chosen in a dump directory")
        return Timeline.load(path)
    if path.is_dir():
        if is_primus_dump(path):
            return load_primus_dump(path, iteration)
        if found := primus_dumps_under(path):
            raise TableFormatError(f"{path} holds {len(found)} Primus dump folders ({', '.join(p.name for p in found)}); "
                                   "pass one of them")
        if (own := _iteration_folder(path)) is not None:
            if iteration is not None and iteration != own:
                raise TableFormatError(f"{path} holds iteration {own}, not {iteration}; pass the dump directory "
                                       f"{path.parent} to choose another")
            return merge_rank_dumps(path.parent, own)
        if iterations := dump_iterations(path):
            return merge_rank_dumps(path, iterations[-1] if iteration is None else iteration)
        files = sorted(path.glob("*.timeline.json"))
        if len(files) == 1 and iteration is None:
            return Timeline.load(files[0])
        if files:
            raise TableFormatError(f"{path} holds {len(files)} timelines ({', '.join(f.name for f in files)}); "
                                   "pass one of them")
    raise TableFormatError(f"{path} is neither {_WHAT}")


def _iteration_folder(path: Path) -> int | None:
    """The iteration ``path`` holds when it is one ``iter_<n>`` folder of a dump directory."""
    return next((i for i in dump_iterations(path.parent) if dump_path(path.parent, i, 0).parent == path), None)


def load_iterations(path: str | os.PathLike) -> list[Timeline]:
    """Every dumped iteration of a run, oldest first (a timeline file gives just itself)."""
    path = Path(path)
    if is_primus_dump(path):
        return load_primus_iterations(path)
    if path.is_dir() and (iterations := dump_iterations(path)):
        return [merge_rank_dumps(path, i) for i in iterations]
    return [load_timeline(path)]


def in_unit(timeline: Timeline, unit: str) -> Timeline:
    """The timeline with its times converted to ``unit`` (``"s"``, ``"ms"`` or ``"us"``)."""
    for u in (unit, timeline.time_unit):
        if u not in TIME_UNITS:
            raise TableFormatError(f"time unit {u!r} is not one of {sorted(TIME_UNITS)}")
    if unit == timeline.time_unit:
        return timeline
    scale = TIME_UNITS[timeline.time_unit] / TIME_UNITS[unit]
    ranks = tuple(replace(r, events=tuple(TimedNode(e.node, e.start * scale, e.end * scale) for e in r.events))
                  for r in timeline.ranks)
    return replace(timeline, ranks=ranks, time_unit=unit)

