"""Run dumps in the real on-disk format (what dump_pp_data writes: one Timeline per rank and iteration,
``meta.t0_unix`` the rank's wall-clock start, times relative to it), made from known timelines."""

from dataclasses import replace

import pytest

from primuspipe.io.timeline import RankTimeline, Timeline, dump_path

T0 = 1024.0
"""The dumps' wall-clock origin: small, so that times shifted by it and back stay exact to well below
the 12 significant digits calibrate keeps (a real Unix time has about 0.2 us resolution in a float)."""


def split_into_rank_files(timeline: Timeline, dump_dir, iteration: int, skew: float = 0.25) -> None:
    """Write ``timeline`` as rank files. Rank r's clock starts ``r * skew`` earlier (ranks enter the step
    at different wall-clock times), so reading the files back must realign them: the merged timeline is
    the original shifted by ``(pp - 1) * skew``. A simulated steady-state step (``meta["period"]``)
    repeats every period, so iteration i starts i periods later on the wall clock."""
    start = T0 + iteration * timeline.meta.get("period", 0.0)
    for rt in timeline.ranks:
        facts = next((r for r in timeline.meta.get("ranks", ()) if r["rank"] == rt.rank), {})
        # a rank's clock starts when it enters the step; without that, an arbitrary skew per rank
        shift = -facts["entered"] if "entered" in facts else rt.rank * skew
        events = tuple(sorted((replace(e, start=e.start + shift, end=e.end + shift) for e in rt.events),
                              key=lambda e: (e.start, e.end)))
        part = replace(timeline, source="run", iteration=iteration,
                       ranks=(RankTimeline(rt.rank, events, rt.peak_memory_bytes),),
                       meta={"t0_unix": start - shift, "device": "cpu", "memory": "peak RSS",
                             **{k: v for k, v in facts.items() if k in ("host",)}})
        part.save(dump_path(dump_dir, iteration, rt.rank))


@pytest.fixture
def write_dump(tmp_path):
    """``write_dump([timeline per iteration])`` -> the dump directory (``name``: its folder, for several runs)."""
    def write(timelines, skew: float = 0.25, name: str = "pp_data"):
        dump_dir = tmp_path / name
        for iteration, timeline in enumerate(timelines):
            split_into_rank_files(timeline, dump_dir, iteration, skew)
        return dump_dir

    return write
