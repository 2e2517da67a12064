"""The timeline format: what the simulator produces and what real runs dump (``dump_pp_data``).

One format for both, so pp_vis draws a simulated step and a measured one the same way and can lay them
side by side. A timeline is a list of timed nodes per rank plus per-rank memory; times are seconds
from the step's start (the simulator may use its cost model's unit, named in ``time_unit``).

JSON layout (``version`` 1; documented in docs/timeline-format.md)::

    {"format": "primuspipe.timeline", "version": 1, "source": "simulator" | "run",
     "algorithm": "1f1b", "pp": 4, "vpp": 1, "microbatches": 8, "iteration": 0, "time_unit": "s",
     "ranks": [{"rank": 0, "peak_memory_bytes": 123, "events": [{"node": "F0.0", "start": 0.0, "end": 1.0}, ...]}, ...]}
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from primuspipe.errors import TableFormatError
from primuspipe.ir.documents import check_envelope, envelope
from primuspipe.ir.node import ScheduleNode

TIMELINE_VERSION = 1


def idle_share(window: float, busy: float) -> float:
    """The bubble rate of a rank: the share of ``window`` it spent not computing (0 for an empty window).

    The one definition the simulator and pp_vis share: ``window`` is the whole step for the step bubble
    rate, the rank's own first-to-last compute for the zero-bubble papers' span figure."""
    return (window - busy) / window if window > 0 else 0.0


@dataclass(frozen=True)
class TimedNode:
    node: ScheduleNode
    start: float
    end: float
    cpu: tuple[float, float] | None = None
    """Run dumps on CPU: the rank's own thread's CPU time at ``start`` and at ``end`` (from its step
    start, in the timeline's unit), so time spent waiting for a core shows as wall time without CPU
    time; None where not measured."""
    bytes: int | None = None
    """Run dumps: the size of the tensor a SEND/RECV node moved; None where not measured."""


@dataclass(frozen=True)
class RankTimeline:
    rank: int
    events: tuple[TimedNode, ...]
    peak_memory_bytes: int | None = None
    """Peak memory of the step on this rank (GPU: peak allocated; CPU: RSS); None if not measured."""


@dataclass(frozen=True)
class Timeline:
    source: str
    """"simulator" or "run"."""
    algorithm: str
    pp: int
    vpp: int
    microbatches: int
    ranks: tuple[RankTimeline, ...]
    iteration: int = 0
    time_unit: str = "s"
    meta: dict = field(default_factory=dict)
    """Free-form facts about how the timeline was made (cost model, host, ...)."""

    @property
    def step_time(self) -> float:
        ends = [e.end for r in self.ranks for e in r.events]
        starts = [e.start for r in self.ranks for e in r.events]
        return max(ends) - min(starts) if ends else 0.0

    def to_dict(self) -> dict:
        header = ("source", "algorithm", "pp", "vpp", "microbatches", "iteration", "time_unit", "meta")
        return {
            **envelope("primuspipe.timeline", TIMELINE_VERSION),
            **{name: getattr(self, name) for name in header},
            "ranks": [
                {
                    "rank": r.rank,
                    "peak_memory_bytes": r.peak_memory_bytes,
                    "events": [_event_dict(e) for e in r.events],
                }
                for r in self.ranks
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Timeline:
        check_envelope(data, "primuspipe.timeline", TIMELINE_VERSION, "timeline")
        try:
            ranks = tuple(
                RankTimeline(
                    int(r["rank"]),
                    tuple(TimedNode(ScheduleNode.parse(e["node"]), float(e["start"]), float(e["end"]),
                                    None if e.get("cpu") is None else (float(e["cpu"][0]), float(e["cpu"][1])),
                                    None if e.get("bytes") is None else int(e["bytes"]))
                          for e in r["events"]),
                    r.get("peak_memory_bytes"),
                )
                for r in data["ranks"]
            )
            return cls(str(data["source"]), str(data["algorithm"]), int(data["pp"]), int(data["vpp"]),
                       int(data["microbatches"]), ranks, int(data.get("iteration", 0)),
                       str(data.get("time_unit", "s")), dict(data.get("meta", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise TableFormatError(f"malformed timeline JSON: {exc!r}") from exc

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise TableFormatError(f"cannot read timeline {path}: {exc}") from exc


def _event_dict(e: TimedNode) -> dict:
    """One event's JSON: node, start, end, and ``cpu`` / ``bytes`` where measured."""
    out = {"node": str(e.node), "start": e.start, "end": e.end}
    if e.cpu is not None:
        out["cpu"] = list(e.cpu)
    if e.bytes is not None:
        out["bytes"] = e.bytes
    return out


# -- run dumps: one file per rank and iteration (written by primuspipe.runtime.recorder) --------
# Kept here, free of torch, so tools can read a cluster's dumps on any machine.
_ITER_DIR = re.compile(r"^iter_(\d+)$")


def dump_path(dump_dir: str | os.PathLike, iteration: int, rank: int) -> Path:
    return Path(dump_dir) / f"iter_{iteration:06d}" / f"rank_{rank}.json"


def dump_iterations(dump_dir: str | os.PathLike) -> list[int]:
    """The iterations dumped under ``dump_dir`` (``iter_<n>`` folders holding rank files), ascending."""
    found = (_ITER_DIR.match(p.name) for p in Path(dump_dir).glob("iter_*") if any(p.glob("rank_*.json")))
    return sorted(int(m[1]) for m in found if m)


def merge_rank_dumps(dump_dir: str | os.PathLike, iteration: int) -> Timeline:
    """All ranks' dumps of one iteration as one timeline, times relative to the earliest rank's start."""
    parts = sorted(
        (Timeline.load(p) for p in (Path(dump_dir) / f"iter_{iteration:06d}").glob("rank_*.json")),
        key=lambda t: t.ranks[0].rank,
    )
    if not parts:
        raise TableFormatError(f"no rank dumps for iteration {iteration} under {dump_dir} (expected "
                               f"{dump_path(dump_dir, iteration, 0)}); dumped iterations: "
                               f"{dump_iterations(dump_dir) or 'none'}")
    origin = min(t.meta["t0_unix"] for t in parts)
    ranks = []
    for part in parts:
        shift = part.meta["t0_unix"] - origin
        (rank,) = part.ranks
        ranks.append(RankTimeline(rank.rank, tuple(replace(e, start=e.start + shift, end=e.end + shift) for e in rank.events),
                                  rank.peak_memory_bytes))
    first = parts[0]
    hosts = [{"rank": part.ranks[0].rank, **{k: part.meta[k] for k in _RANK_FACTS if k in part.meta}} for part in parts]
    return Timeline("run", first.algorithm, first.pp, first.vpp, first.microbatches, tuple(ranks), iteration,
                    meta={"t0_unix": origin, "device": first.meta.get("device"), "memory": first.meta.get("memory"),
                          "ranks": hosts})


_RANK_FACTS = ("t0_unix", "host", "cpus", "threads", "process_cpu", "thread_cpu")
"""What a rank's dump says about where and how it ran (see primuspipe.runtime.recorder); kept per rank
in the merged timeline's ``meta["ranks"]``."""
