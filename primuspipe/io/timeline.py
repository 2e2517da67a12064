"""The timeline format: what the simulator produces and what real runs dump (``dump_pp_data``).

One format for both, so pp_vis draws a simulated step and a measured one the same way and can lay them
side by side. A timeline is a list of timed nodes per rank plus per-rank memory; times are seconds
from the step's start (the simulator may use its cost model's unit, named in ``time_unit``).

JSON layout (``version`` 1; documented in docs/timeline-format.md)::

    {"format": "primuspipe.timeline", "version": 1, "source": "simulator" | "run",
     "algorithm": "1f1b", "pp": 4, "vpp": 1, "microbatches": 8, "iteration": 0, "time_unit": "s",
     "ranks": [{"rank": 0, "peak_memory_bytes": 123, "events": [{"node": "F0.0", "start": 0.0, "end": 1.0}, ...]}, ...]}

This module is the document alone: its values, their JSON form (every field checked as it is read), whether it
is one whole step, and where a run's per-rank files lie. Laying those files on one time axis is
:mod:`~primuspipe.io.run_dumps`'; meeting a timeline's events with a table's wiring and placement is
:mod:`~primuspipe.io.timeline_wiring`'s -- both read timelines, neither is needed to read or write one.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primuspipe.errors import TableFormatError
from primuspipe import strict
from primuspipe.ir.cost_model import MAX_TIME
from primuspipe.ir.cost_parts import TIME_UNITS
from primuspipe.documents import check_envelope, envelope, output_file, write_atomically
from primuspipe.ir.kinds import NodeKind, kinds_completing, split_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.limits import MAX_NODES, check_shape

TIMELINE_VERSION = 1
_KEYS = {"format", "version", "source", "algorithm", "pp", "vpp", "microbatches", "iteration", "time_unit", "meta",
         "ranks"}
_RANK_KEYS = {"rank", "peak_memory_bytes", "events"}
_EVENT_KEYS = {"node", "start", "end", "cpu", "bytes", "layers", "ends"}


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
    layers: tuple[float, float | None] | None = None
    """Run dumps of a backend that knows the model's layer stack (Megatron: the decoder): the wall time
    and the thread's CPU time (None where not measured) the node spent inside it, so calibration can
    tell a chunk's fixed cost from its per-layer cost; None where not measured."""
    ends: tuple[float, float | None] | None = None
    """Likewise, the time in the module only the first stage holds (Megatron: the embedding's forward),
    so calibration can tell it from the fixed cost every chunk pays."""

    @property
    def cpu_time(self) -> float | None:
        """The CPU time the rank's thread spent in the node; None where not measured."""
        return None if self.cpu is None else self.cpu[1] - self.cpu[0]


@dataclass(frozen=True)
class RankTimeline:
    rank: int
    events: tuple[TimedNode, ...]
    peak_memory_bytes: int | None = None
    """Peak memory of the step on this rank (GPU: peak allocated; CPU: RSS); None if not measured."""

    @property
    def span(self) -> float:
        """From its first node's start to its last node's end: the window a run's CPU counters cover
        (the recorder reads them around the step)."""
        return max((e.end for e in self.events), default=0.0) - min((e.start for e in self.events), default=0.0)

    @property
    def messages(self) -> int:
        """How many sends and receives the rank made (each costs its process CPU off the main thread:
        ``host.message_cpu``)."""
        return sum(1 for e in self.events if e.node.kind.is_send or e.node.kind.is_recv)


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

    def check_one_step(self, where: str) -> Timeline:
        """Refuse a timeline that is not one whole step of its shape: on every rank it times, each of its
        chunks runs every microbatch's forward exactly once, and its backward once too -- as a B and a W
        or as one BW -- (or, in a forward-only step, no rank runs any backward). A dropped event, a
        duplicated microbatch or a header whose microbatch count is not the events' is named here, before
        anything is drawn or measured from it. Returns the timeline."""
        counts = [Counter((kind, mb, chunk) for e in r.events if e.node.kind.is_compute
                          for kind, mb, chunk in e.node.parts()) for r in self.ranks]
        forward_only = not any(k is not NodeKind.F for c in counts for k, _, _ in c)
        # each step once: F, B (alone or in a BW), W (alone or in a BW)
        need = [kinds_completing(step) for step in split_kinds()[:1 if forward_only else None]]
        for rank, seen in zip(self.ranks, counts):
            if twice := next((key for key, n in seen.items() if n > 1), None):
                raise TableFormatError(f"{where}: rank {rank.rank} runs {_part(twice)} {seen[twice]} times; a step runs "
                                       "each node once (a duplicated event or microbatch)")
            posts = Counter(e.node for e in rank.events if not e.node.kind.is_compute)
            if twice := next((node for node, n in posts.items() if n > 1), None):
                raise TableFormatError(f"{where}: rank {rank.rank} posts {twice} {posts[twice]} times; a step moves each "
                                       "activation and gradient once (a duplicated event)")
            for chunk in range(self.vpp):
                for mb in range(self.microbatches):
                    for options in need:
                        if not any(seen[(kind, mb, chunk)] for kind in options):
                            raise TableFormatError(
                                f"{where}: rank {rank.rank} has no {_part((options[0], mb, chunk))} event, but the step "
                                f"has {self.microbatches} microbatches x {self.vpp} chunks; an event was dropped or the "
                                "header's shape is not the events'")
            self._check_step_order(rank, where)
        return self

    @staticmethod
    def _check_step_order(rank: RankTimeline, where: str) -> None:
        """On one rank each (microbatch, chunk) runs its steps in order: its B after its F, its W after its B (a
        fused or overlapped node does two at once). A dump naming a backward before its forward was drawn as
        it stood, and calibrate read it as a table that deadlocks ("cannot complete"), naming no file."""
        steps = split_kinds()
        at: dict[tuple, int] = {}
        for i, event in enumerate(e for e in rank.events if e.node.kind.is_compute):
            for kind, mb, chunk in event.node.parts():
                for step in kind.completes:
                    at.setdefault((step, mb, chunk), i)
        for (step, mb, chunk), i in at.items():
            k = steps.index(step) if step in steps else 0
            if k and at.get((steps[k - 1], mb, chunk), -1) > i:
                raise TableFormatError(f"{where}: rank {rank.rank} runs {_part((step, mb, chunk))} before "
                                       f"{_part((steps[k - 1], mb, chunk))}; a microbatch's steps run in order on a "
                                       "rank (an event misnamed, or the events out of order)")

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
    def from_dict(cls, data: dict, where: str = "timeline JSON") -> Timeline:
        """A timeline from its JSON form, checked field by field: a known shape, ranks within it, each
        event a node of that shape with finite times ``0 <= start <= end``, a rank's compute events
        one after another, and a finite wall-clock ``meta.t0_unix`` where given."""
        check_envelope(data, "primuspipe.timeline", TIMELINE_VERSION, "timeline", where)
        data = strict.keys(data, where, _KEYS, required={"source", "algorithm", "pp", "vpp", "microbatches", "ranks"},
                           error=TableFormatError)
        pp, vpp, m = (strict.count(data[k], f"{where}: {k}", minimum=1, error=TableFormatError)
                      for k in ("pp", "vpp", "microbatches"))
        check_shape(pp, vpp, m)
        meta = _checked_meta(data.get("meta", {}), f"{where}: meta")
        if not isinstance(data["ranks"], list):
            raise TableFormatError(f"{where}: ranks must be a list of {{rank, peak_memory_bytes, events}}")
        ranks = tuple(_rank_timeline(r, f"{where}: ranks[{i}]", pp, vpp, m) for i, r in enumerate(data["ranks"]))
        if sum(len(r.events) for r in ranks) > MAX_NODES:
            raise TableFormatError(f"{where}: more than {MAX_NODES:,} events, more than any table has nodes")
        seen = [r.rank for r in ranks]
        if len(set(seen)) != len(seen):
            raise TableFormatError(f"{where}: rank {next(r for r in seen if seen.count(r) > 1)} appears twice")
        return cls(strict.text(data["source"], f"{where}: source", choices={"simulator", "run"}, error=TableFormatError),
                   strict.text(data["algorithm"], f"{where}: algorithm", error=TableFormatError), pp, vpp, m, ranks,
                   strict.count(data.get("iteration", 0), f"{where}: iteration", error=TableFormatError),
                   strict.text(data.get("time_unit", "s"), f"{where}: time_unit", choices=TIME_UNITS,
                               error=TableFormatError), meta)

    def save(self, path: str | Path) -> Path:
        """Write the JSON form atomically (a reader sees the whole file or none), creating folders."""
        return write_atomically(output_file(path, "timeline file", writes="JSON"),
                                json.dumps(self.to_dict(), allow_nan=False))

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        text = strict.read_text(path, "timeline", error=TableFormatError)
        return cls.from_dict(strict.load_json(text, str(path), error=TableFormatError), str(path))


def _text_or_null(value: Any, name: str) -> Any:
    return None if value is None else strict.text(value, name, error=TableFormatError)


def _share(value: Any, name: str) -> float:
    return strict.number(value, name, minimum=0, maximum=1, error=TableFormatError)


def _seconds(value: Any, name: str) -> float:
    return strict.number(value, name, minimum=0, error=TableFormatError)


def _cores(value: Any, name: str) -> int:
    return strict.count(value, name, minimum=1, error=TableFormatError)


_FACTS: dict[str, Callable[[Any, str], Any]] = {
    "t0_unix": _seconds, "entered": _seconds, "thread_cpu": _seconds, "process_cpu": _seconds, "period": _seconds,
    "step_time": _seconds, "memory_at_start": _seconds, "bubble_rate": _share, "bubble_rate_mean": _share,
    "cpus": _cores, "threads": _cores, "run_id": _text_or_null, "host": _text_or_null, "device": _text_or_null,
    "memory": _text_or_null, "origin": _text_or_null,
}
"""The ``meta`` facts readers use, each with its reader: a run id that was a list (unhashable, a TypeError where
runs are told apart), a ``host`` that was a list (a TypeError in calibrate's core count) or a CPU time that was text
went in as given. Other keys are free-form."""


def _checked_meta(meta: object, where: str) -> dict:
    """A timeline's ``meta`` with its known facts (:data:`_FACTS`) read, each rank's in ``meta.ranks`` too: a fact
    written as number text (``"t0_unix": "1"``) is kept as the number it reads as, never as the text that
    later arithmetic would trip on."""
    if not isinstance(meta, dict):
        raise TableFormatError(f"{where} must be a mapping, got {strict.show(meta)}")
    ranks = meta.get("ranks", [])
    if not isinstance(ranks, list):
        raise TableFormatError(f"{where}.ranks must be a list of per-rank facts, got {strict.show(ranks)}")
    for i, facts in enumerate(ranks):
        if not isinstance(facts, dict) or "rank" not in facts:
            raise TableFormatError(f"{where}.ranks[{i}] must be a mapping with a rank, got {strict.show(facts)}")
        strict.count(facts["rank"], f"{where}.ranks[{i}].rank", error=TableFormatError)
    meta = _read_facts(meta, where)
    if ranks:
        meta["ranks"] = [_read_facts(facts, f"{where}.ranks[{i}]") for i, facts in enumerate(ranks)]
    if "placement" in meta:
        Placement.from_dict(meta["placement"], f"{where}.placement")
    return meta


def _read_facts(facts: dict, where: str) -> dict:
    """A copy of ``facts`` with each known fact replaced by what its reader makes of it."""
    return {**facts, **{key: _FACTS[key](facts[key], f"{where}.{key}") for key in _FACTS.keys() & facts.keys()}}


def _rank_timeline(data: object, where: str, pp: int, vpp: int, m: int) -> RankTimeline:
    data = strict.keys(data, where, _RANK_KEYS, required={"rank", "events"}, error=TableFormatError)
    rank = strict.count(data["rank"], f"{where}.rank", maximum=pp - 1, error=TableFormatError)
    peak = data.get("peak_memory_bytes")
    if peak is not None:
        strict.count(peak, f"{where}.peak_memory_bytes", error=TableFormatError)
    if not isinstance(data["events"], list):
        raise TableFormatError(f"{where}.events must be a list of {{node, start, end}}")
    events = []
    busy_until = 0.0
    for i, e in enumerate(data["events"]):
        at = f"{where}.events[{i}]"
        e = strict.keys(e, at, _EVENT_KEYS, required={"node", "start", "end"}, error=TableFormatError)
        node = ScheduleNode.parse(strict.text(e["node"], f"{at}.node", error=TableFormatError))
        start = strict.number(e["start"], f"{at}.start", minimum=0, maximum=MAX_TIME, error=TableFormatError)
        end = strict.number(e["end"], f"{at}.end", minimum=start, maximum=MAX_TIME, error=TableFormatError)
        if any(mb >= m or chunk >= vpp for _, mb, chunk in node.parts()) or (node.peer or 0) >= pp:
            raise TableFormatError(f"{at}: {node} lies outside the timeline's shape (pp={pp}, vpp={vpp}, {m} microbatches)")
        if node.kind.is_compute:
            if start < busy_until - 1e-9 * max(1.0, busy_until):
                raise TableFormatError(f"{at}: {node} starts at {start:g}, before the rank's previous compute node ends "
                                       f"({busy_until:g}); a rank runs one compute node at a time (events in start order)")
            busy_until = end
        cpu = e.get("cpu")
        if cpu is not None:
            if not isinstance(cpu, list) or len(cpu) != 2:
                raise TableFormatError(f"{at}.cpu must be [start, end] of the thread's CPU time, got {strict.show(cpu)}")
            first = strict.number(cpu[0], f"{at}.cpu[0]", minimum=0, error=TableFormatError)
            cpu = first, strict.number(cpu[1], f"{at}.cpu[1] (the thread's CPU time at the node's end, not before "
                                               "its start)", minimum=first, error=TableFormatError)
        size = e.get("bytes")
        if size is not None:
            size = strict.count(size, f"{at}.bytes", error=TableFormatError)
        events.append(TimedNode(node, start, end, cpu, size, *(_inside(e.get(part), f"{at}.{part}", end - start)
                                                               for part in ("layers", "ends"))))
    return RankTimeline(rank, tuple(events), peak)


def _part(key: tuple) -> str:
    kind, mb, chunk = key
    return str(ScheduleNode(kind, mb, chunk))


def _event_dict(e: TimedNode) -> dict:
    """One event's JSON: node, start, end, and ``cpu`` / ``bytes`` / ``layers`` / ``ends`` where measured."""
    out = {"node": str(e.node), "start": e.start, "end": e.end}
    if e.cpu is not None:
        out["cpu"] = list(e.cpu)
    if e.bytes is not None:
        out["bytes"] = e.bytes
    if e.layers is not None:
        out["layers"] = list(e.layers)
    if e.ends is not None:
        out["ends"] = list(e.ends)
    return out


def _inside(value, at: str, span: float) -> tuple[float, float | None] | None:
    """An event's ``layers`` or ``ends``: ``[wall, cpu]`` seconds inside that part of the model (cpu may be
    null), at most the node's own time (a little clock noise allowed)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise TableFormatError(f"{at} must be [wall, cpu] seconds the node spent in that part of the model "
                               f"(cpu may be null), got {strict.show(value)}")
    wall = strict.number(value[0], f"{at}[0]", minimum=0, error=TableFormatError)
    if wall > span * (1 + 1e-6) + 1e-9:
        raise TableFormatError(f"{at}[0] = {wall:g} is longer than the node itself ({span:g}); the time in a part "
                               "of the model is part of the node's time")
    cpu = None if value[1] is None else strict.number(value[1], f"{at}[1]", minimum=0, error=TableFormatError)
    return wall, cpu


# -- where a run's dumps lie: one file per rank and iteration (written by primuspipe.runtime.recorder) ---------
# The layout is the format's (docs/timeline-format.md): the recorder writes by it and every reader finds files by
# it; reading the files of one iteration into one timeline is primuspipe.io.run_dumps'.
_ITER_DIR = re.compile(r"iter_([0-9]{6,})", re.ASCII)


def dump_path(dump_dir: str | os.PathLike, iteration: int, rank: int) -> Path:
    """Where ``rank``'s dump of ``iteration`` lies under ``dump_dir``: ``iter_<n>/rank_<rank>.json``, ``n`` padded
    to six digits so the folders sort by iteration."""
    return Path(dump_dir) / f"iter_{iteration:06d}" / f"rank_{rank}.json"


def dump_iterations(dump_dir: str | os.PathLike) -> list[int]:
    """The iterations dumped under ``dump_dir`` (``iter_<n>`` folders holding rank files), ascending."""
    found = (_ITER_DIR.fullmatch(p.name) for p in Path(dump_dir).glob("iter_*") if any(p.glob("rank_*.json")))
    return sorted(int(m[1]) for m in found if m and m[0] == f"iter_{int(m[1]):06d}")
