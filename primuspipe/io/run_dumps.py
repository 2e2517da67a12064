"""A run's dumps read back as one step: every rank's file of an iteration laid on one time axis.

Each rank of a run writes its own timeline per iteration (:func:`~primuspipe.io.timeline.dump_path`, by
:mod:`primuspipe.runtime.recorder`), its times from its own step start and its wall-clock start in
``meta.t0_unix``. Merging them is where files that do not belong together are caught -- a rank missing, a file
of another run, iteration or placement, clocks that disagree -- so every reader (``vis``, ``calibrate``, the
re-planner) gets one whole step or a message naming the file. Kept free of torch, so tools read a cluster's dumps
on any machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from primuspipe.errors import TableFormatError
from primuspipe.io.timeline import RankTimeline, Timeline, dump_iterations, dump_path
from primuspipe.io.timeline_wiring import placement_of_events, timed_transfers
from primuspipe.ir.table import ScheduleTable


def merge_rank_dumps(dump_dir: str | os.PathLike, iteration: int) -> Timeline:
    """All ranks' dumps of one iteration as one timeline, times relative to the earliest rank's start.

    Refuses, saying what is wrong, an iteration that is not one whole step of one run: a rank's file
    missing (a run stopped mid-step), a file holding another rank or iteration than its name says, or
    files of different runs (``meta.run_id``) or shapes."""
    folder = dump_path(dump_dir, iteration, 0).parent
    parts = [_rank_dump(path, iteration) for path in sorted(folder.glob("rank_*.json"))]
    if not parts:
        raise TableFormatError(f"no rank dumps for iteration {iteration} under {dump_dir} (expected "
                               f"{dump_path(dump_dir, iteration, 0)}); dumped iterations: "
                               f"{dump_iterations(dump_dir) or 'none'}")
    return merge_rank_timelines(parts, iteration, f"iteration {iteration} in {folder}")


def merge_rank_timelines(parts: Sequence[Timeline], iteration: int, where: str) -> Timeline:
    """One timeline from every rank's own of one step (a run dump's files, or what the ranks of a live
    run gathered), times relative to the earliest rank's start. Refused, naming ``where``, unless the
    parts are one whole step of one run (see :func:`merge_rank_dumps`)."""
    parts = sorted(parts, key=lambda t: t.ranks[0].rank)
    first = parts[0]
    for part in parts[1:]:
        if run_of(part) != run_of(first):
            raise TableFormatError(
                f"{where} mixes rank files of different runs: rank {first.ranks[0].rank} is "
                f"{describe_run(first)} but rank {part.ranks[0].rank} is {describe_run(part)}; delete the stale files or "
                "dump each run into its own directory")
    if missing := sorted(set(range(first.pp)) - {t.ranks[0].rank for t in parts}):
        raise TableFormatError(f"{where} is incomplete: rank file(s) of rank(s) "
                               f"{', '.join(map(str, missing))} of pp={first.pp} are missing (the run stopped before "
                               "they were written?)")
    placement = first.meta.get("placement")
    if other := next((part for part in parts if part.meta.get("placement") != placement), None):
        raise TableFormatError(f"{where}: rank {first.ranks[0].rank} and rank {other.ranks[0].rank} record different "
                               "placements (meta.placement); one run has one placement, so these files were edited "
                               "or mixed")
    origin = min(t.meta["t0_unix"] for t in parts)
    ranks = []
    for part in parts:
        shift = part.meta["t0_unix"] - origin
        (rank,) = part.ranks
        ranks.append(RankTimeline(rank.rank, tuple(replace(e, start=e.start + shift, end=e.end + shift) for e in rank.events),
                                  rank.peak_memory_bytes))
    hosts = [{"rank": part.ranks[0].rank, **{k: part.meta[k] for k in _RANK_FACTS if k in part.meta}} for part in parts]
    merged = Timeline("run", first.algorithm, first.pp, first.vpp, first.microbatches, tuple(ranks), iteration,
                      meta={"t0_unix": origin, "device": first.meta.get("device"), "memory": first.meta.get("memory"),
                            "run_id": first.meta.get("run_id"), "ranks": hosts,
                            **({} if placement is None else {"placement": placement})}).check_one_step(where)
    _check_clocks(merged, where)
    return merged


def _check_clocks(timeline: Timeline, where: str) -> None:
    """Refuse ranks whose clocks disagree by more than a rank's whole step: a receive that ended before its send
    started by more than the longest rank's span (each rank's span is its own clock's, so no skew hides in it).
    The ranks are set on one time line by their ``t0_unix``; hosts whose clocks were never synchronised, or a
    rank file edited, gave a step of days and every rank 100 % idle, and calibrate a replay 100 % off, without a
    word. A send meets its receive as :mod:`~primuspipe.io.timeline_wiring` matches them: by the table's wiring
    over the placement the timeline ran."""
    placement = placement_of_events(timeline)
    events = {rank.rank: rank.events for rank in timeline.ranks}
    rows = [events.get(rank, ()) for rank in range(timeline.pp)]
    wiring = ScheduleTable(placement, timeline.microbatches, tuple(tuple(e.node for e in row) for row in rows)).wiring
    sent, received = timed_transfers(rows, wiring)
    longest = max((r.span for r in timeline.ranks), default=0.0)
    for key, send in sent.items():
        if (receive := received.get(key)) is not None and send.start - receive.end > longest:
            transfer = wiring.transfer(key)
            src, dst = placement.rank_of(transfer.src_stage), placement.rank_of(transfer.dst_stage)
            raise TableFormatError(
                f"{where}: rank {dst}'s receive of the {transfer} from rank {src} ended "
                f"{send.start - receive.end:.6g} {timeline.time_unit} before rank {src} began sending it, more than "
                f"a whole rank's step ({longest:.6g} {timeline.time_unit}): the ranks' clocks (t0_unix) disagree; "
                "dump from hosts with synchronised clocks (NTP/PTP)")


_RANK_FACTS = ("t0_unix", "host", "cpus", "threads", "process_cpu", "thread_cpu", "memory_at_start")
"""What a rank's dump says about where and how it ran (see primuspipe.runtime.recorder); kept per rank
in the merged timeline's ``meta["ranks"]``."""


def _rank_dump(path: Path, iteration: int) -> Timeline:
    """One rank's dump file, refused unless it holds the rank and iteration its path names."""
    part = Timeline.load(path)
    ranks = [r.rank for r in part.ranks]
    if len(ranks) != 1 or path != dump_path(path.parent.parent, iteration, ranks[0]):
        raise TableFormatError(f"{path} holds rank(s) {ranks}, not the one rank its name says; a run dump has one "
                               "file per rank named rank_<rank>.json")
    if part.iteration != iteration:
        raise TableFormatError(f"{path} is iteration {part.iteration}, not {iteration} as its folder says; it was "
                               "moved or copied from elsewhere")
    if "t0_unix" not in part.meta:
        raise TableFormatError(f"{path} lacks meta.t0_unix (the rank's wall-clock step start), so it is no run dump")
    return part


def run_of(part: Timeline) -> tuple:
    """What one run's files share (its id and shape): files that differ in it are of different runs."""
    return part.meta.get("run_id"), part.algorithm, part.pp, part.vpp, part.microbatches, part.time_unit


def describe_run(part: Timeline) -> str:
    """:func:`run_of` in words, for the messages that refuse files of different runs."""
    run_id = part.meta.get("run_id")
    return (f"{part.algorithm} pp={part.pp} vpp={part.vpp} m={part.microbatches}"
            + (f" of run {run_id}" if run_id else " (no run id)"))
