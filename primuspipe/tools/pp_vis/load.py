"""What pp_vis reads: a timeline JSON file (``primuspipe simulate -o DIR`` writes them), a run's dump
directory (``dump_pp_data``: ``<dump_dir>/iter_<n>/rank_<r>.json``), both in the one timeline format, or
a Primus dump folder (its runs' ``dump_pp_data`` or its simulator's output: ``config.json`` and
``pp_rank_<r>.json``, :mod:`primuspipe.tools.pp_vis.primus_dump`).

A dump directory is read one whole step at a time: an iteration missing a rank's file (a run killed
mid-step), mixing runs, or with malformed files is skipped, and so are iterations of an older run
left in the same directory; each skip is logged as a warning saying which iteration and why. Asked
for one iteration by number, the reader refuses it instead of skipping it."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from primuspipe import strict
from primuspipe.errors import TableFormatError
from primuspipe.ir.cost_model import TIME_UNITS
from primuspipe.io.run_dumps import describe_run, merge_rank_dumps, run_of
from primuspipe.io.timeline import TimedNode, Timeline, dump_iterations, dump_path
from primuspipe.tools.pp_vis.primus_dump import (
    is_primus_dump,
    load_primus_dump,
    load_primus_iterations,
    primus_dumps_under,
)

logger = logging.getLogger(__name__)

_KINDS = ("a timeline JSON file (from 'primuspipe simulate -o DIR')", "a dump directory holding "
          "iter_<n>/rank_<r>.json (from a run with dump_pp_data, e.g. examples/train_gpt.py --dump-dir DIR)",
          "a Primus dump folder holding config.json and pp_rank_<r>.json")
"""What a timeline input can be, for the messages that refuse one."""


@strict.arguments()
def load_timeline(path: str | os.PathLike, iteration: int | None = None) -> Timeline:
    """One timeline from a file, or from a dump directory (all ranks of ``iteration`` merged on one
    time axis; by default the last whole iteration of the newest run, the warmest). A folder
    ``iter_<n>`` itself, or a folder holding exactly one ``*.timeline.json``, works too."""
    path = strict.file_path(path, "timeline or dump directory", error=TableFormatError)
    if _is_file(path):
        if iteration is not None:
            raise TableFormatError(f"{path} is one timeline file; an iteration can only be chosen in a dump directory")
        return _whole(Timeline.load(path), path)
    if path.is_dir():
        _check_readable(path)
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
            if iteration is not None:
                return merge_rank_dumps(path, iteration)
            return _newest_run(path, iterations)[-1]
        files = sorted(path.glob("*.timeline.json"))
        if len(files) == 1 and iteration is None:
            return _whole(Timeline.load(files[0]), files[0])
        if files:
            raise TableFormatError(f"{path} holds {len(files)} timelines ({', '.join(f.name for f in files)}); "
                                   "pass one of them")
    if not path.exists():  # a mistyped path is the likeliest first mistake: say so before what the input could be
        raise TableFormatError(f"cannot read {path}: it does not exist; give {', '.join(_KINDS[:-1])} or {_KINDS[-1]}")
    raise TableFormatError(f"{path} is neither {', '.join(_KINDS[:-1])}, nor {_KINDS[-1]}")


def _iteration_folder(path: Path) -> int | None:
    """The iteration ``path`` holds when it is one ``iter_<n>`` folder of a dump directory."""
    return next((i for i in dump_iterations(path.parent) if dump_path(path.parent, i, 0).parent == path), None)


@strict.arguments()
def load_iterations(path: str | os.PathLike) -> list[Timeline]:
    """Every dumped iteration of a run, oldest first (a timeline file gives just itself)."""
    path = strict.file_path(path, "timeline or dump directory", error=TableFormatError)
    _check_readable(path)
    if is_primus_dump(path):
        return load_primus_iterations(path)
    if path.is_dir() and (iterations := dump_iterations(path)):
        return _newest_run(path, iterations)
    return [load_timeline(path)]


def _check_readable(path: Path) -> None:
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise TableFormatError(f"cannot read the directory {path}: permission denied (check its permissions)")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except PermissionError:
        raise TableFormatError(f"cannot read {path}: permission denied (check the permissions of its folders)") from None


def _whole(timeline: Timeline, path: Path) -> Timeline:
    """A timeline file must time every rank (one rank's dump file belongs in its dump directory)."""
    if missing := sorted(set(range(timeline.pp)) - {r.rank for r in timeline.ranks}):
        raise TableFormatError(f"{path} has no events for rank(s) {', '.join(map(str, missing))} of pp={timeline.pp}; "
                               "a rank's dump file is read with its dump directory (pass the directory)")
    return timeline.check_one_step(str(path))


def _newest_run(dump_dir: Path, iterations: list[int]) -> list[Timeline]:
    """The whole iterations of the newest run in ``dump_dir``, oldest first; every other one is skipped
    with a warning saying why."""
    merged, skipped = [], []
    for i in iterations:
        try:
            merged.append(merge_rank_dumps(dump_dir, i))
        except TableFormatError as exc:
            skipped.append((i, str(exc)))
    if not merged:
        i, why = skipped[-1]
        raise TableFormatError(f"{dump_dir} holds no whole iteration; the last one, {i}, is refused: {why}")
    runs: dict = {}
    for t in merged:
        if (run_id := t.meta.get("run_id")) is not None and runs.setdefault(run_id, t) and run_of(runs[run_id]) != run_of(t):
            raise TableFormatError(f"{dump_dir}: run {run_id} is {describe_run(runs[run_id])} at iteration "
                                   f"{runs[run_id].iteration} but {describe_run(t)} at iteration {t.iteration}; one run "
                                   "keeps one schedule, so these files were edited or mixed")
    newest = max(merged, key=lambda t: t.meta["t0_unix"])
    kept = [t for t in merged if run_of(t) == run_of(newest)]
    skipped += [(t.iteration, f"it belongs to an older run ({describe_run(t)}) than the newest one "
                              f"({describe_run(newest)})") for t in merged if run_of(t) != run_of(newest)]
    for i, why in sorted(skipped):
        logger.warning("skipped iteration %d of %s: %s", i, dump_dir, why)
    return kept


def in_unit(timeline: Timeline, unit: str) -> Timeline:
    """The timeline with its times converted to ``unit`` (``"s"``, ``"ms"`` or ``"us"``)."""
    for u in (unit, timeline.time_unit):
        if u not in TIME_UNITS:
            raise TableFormatError(f"time unit {u!r} is not one of {sorted(TIME_UNITS)}")
    if unit == timeline.time_unit:
        return timeline
    scale = TIME_UNITS[timeline.time_unit] / TIME_UNITS[unit]
    def scaled(e: TimedNode) -> TimedNode:
        cpu = None if e.cpu is None else (e.cpu[0] * scale, e.cpu[1] * scale)
        return replace(e, start=e.start * scale, end=e.end * scale, cpu=cpu)

    ranks = tuple(replace(r, events=tuple(map(scaled, r.events))) for r in timeline.ranks)
    return replace(timeline, ranks=ranks, time_unit=unit)

