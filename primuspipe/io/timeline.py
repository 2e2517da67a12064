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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from primuspipe.errors import TableFormatError
from primuspipe import strict
from primuspipe.ir.cost_model import TIME_UNITS
from primuspipe.documents import check_envelope, envelope, output_file, write_atomically
from primuspipe.ir.kinds import NodeKind, kinds_completing, split_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.dataflow import Wiring
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
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
    """A timeline's ``meta``, its known facts (:data:`_FACTS`) checked, each rank's in ``meta.ranks`` too."""
    if not isinstance(meta, dict):
        raise TableFormatError(f"{where} must be a mapping, got {strict.show(meta)}")
    ranks = meta.get("ranks", [])
    if not isinstance(ranks, list):
        raise TableFormatError(f"{where}.ranks must be a list of per-rank facts, got {strict.show(ranks)}")
    for i, facts in enumerate(ranks):
        if not isinstance(facts, dict) or "rank" not in facts:
            raise TableFormatError(f"{where}.ranks[{i}] must be a mapping with a rank, got {strict.show(facts)}")
        strict.count(facts["rank"], f"{where}.ranks[{i}].rank", error=TableFormatError)
    for facts, at in [(meta, where), *((facts, f"{where}.ranks[{i}]") for i, facts in enumerate(ranks))]:
        for key in _FACTS.keys() & facts.keys():
            _FACTS[key](facts[key], f"{at}.{key}")
    if "placement" in meta:
        Placement.from_dict(meta["placement"], f"{where}.placement")
    return meta


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
        start = strict.number(e["start"], f"{at}.start", minimum=0, error=TableFormatError)
        end = strict.number(e["end"], f"{at}.end", minimum=start, error=TableFormatError)
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


# -- run dumps: one file per rank and iteration (written by primuspipe.runtime.recorder) --------
# Kept here, free of torch, so tools can read a cluster's dumps on any machine.
_ITER_DIR = re.compile(r"iter_([0-9]{6,})", re.ASCII)


def dump_path(dump_dir: str | os.PathLike, iteration: int, rank: int) -> Path:
    return Path(dump_dir) / f"iter_{iteration:06d}" / f"rank_{rank}.json"


def dump_iterations(dump_dir: str | os.PathLike) -> list[int]:
    """The iterations dumped under ``dump_dir`` (``iter_<n>`` folders holding rank files), ascending."""
    found = (_ITER_DIR.fullmatch(p.name) for p in Path(dump_dir).glob("iter_*") if any(p.glob("rank_*.json")))
    return sorted(int(m[1]) for m in found if m and m[0] == f"iter_{int(m[1]):06d}")


def merge_rank_dumps(dump_dir: str | os.PathLike, iteration: int) -> Timeline:
    """All ranks' dumps of one iteration as one timeline, times relative to the earliest rank's start.

    Refuses, saying what is wrong, an iteration that is not one whole step of one run: a rank's file
    missing (a run stopped mid-step), a file holding another rank or iteration than its name says, or
    files of different runs (``meta.run_id``) or shapes."""
    folder = Path(dump_dir) / f"iter_{iteration:06d}"
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
    word. A send meets its receive by the table's wiring (:func:`timed_transfers`) over the timeline's events on
    the placement it ran (:func:`placement_of_events`): a microbatch's chunks cross one link once each, and only
    the stages tell which of them a send or a receive moved."""
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


def timed_transfers(rows: Sequence[Sequence[TimedNode | None]], wiring: Wiring
                    ) -> tuple[dict[int, TimedNode], dict[int, TimedNode]]:
    """Each transfer's send event and receive event, by the wiring's transfer key: ``rows[rank][i]`` is the event
    of the wiring's node ``i`` of ``rank`` (None where it was not recorded). The one way a timeline's sends meet
    their receives, for the clock check and calibration's walk alike."""
    sent: dict[int, TimedNode] = {}
    received: dict[int, TimedNode] = {}
    for row, moves in zip(rows, wiring.moves):
        for e, key in zip(row, moves):
            if key >= 0 and e is not None:
                (sent if e.node.kind.is_send else received)[key] = e
    return sent, received


def placement_of_events(timeline: Timeline) -> Placement:
    """Where the timeline's stages lived, as far as the timeline itself says: the placement it records (the
    recorder and the simulator write it; a merge keeps it), else the built-in layout its communication shows
    (:meth:`~primuspipe.ir.placement.Placement.shown_by`: dumps of older recorders record none). Not the layout
    the timeline's algorithm is registered with: that is the registry's to say, above this module
    (:func:`~primuspipe.calibration.replay.placement_of`)."""
    if "placement" not in timeline.meta:
        return Placement.shown_by(timeline.pp, timeline.vpp, forwarded_from_rank_0(timeline))
    placement = Placement.from_dict(timeline.meta["placement"], "a timeline's meta.placement")
    if (placement.pp, placement.vpp) != (timeline.pp, timeline.vpp):
        raise TableFormatError(f"the timeline is pp={timeline.pp} vpp={timeline.vpp} but its meta.placement is "
                               f"pp={placement.pp} vpp={placement.vpp}; the placement belongs to another run")
    return placement


def forwarded_from_rank_0(timeline: Timeline) -> list[int]:
    """The chunks rank 0 sends activations from in ``timeline``: what shows a layout the timeline does not record
    (:meth:`~primuspipe.ir.placement.Placement.shown_by`); none where it times no such send."""
    rank_0 = next((r.events for r in timeline.ranks if r.rank == 0), ())
    return [e.node.chunk for e in rank_0 if e.node.kind.is_send and e.node.kind.carries is NodeKind.F]


_RANK_FACTS = ("t0_unix", "host", "cpus", "threads", "process_cpu", "thread_cpu", "memory_at_start")
"""What a rank's dump says about where and how it ran (see primuspipe.runtime.recorder); kept per rank
in the merged timeline's ``meta["ranks"]``."""


def _rank_dump(path: Path, iteration: int) -> Timeline:
    """One rank's dump file, refused unless it holds the rank and iteration its path names."""
    part = Timeline.load(path)
    ranks = [r.rank for r in part.ranks]
    if len(ranks) != 1 or path.name != f"rank_{ranks[0]}.json":
        raise TableFormatError(f"{path} holds rank(s) {ranks}, not the one rank its name says; a run dump has one "
                               "file per rank named rank_<rank>.json")
    if part.iteration != iteration:
        raise TableFormatError(f"{path} is iteration {part.iteration}, not {iteration} as its folder says; it was "
                               "moved or copied from elsewhere")
    if "t0_unix" not in part.meta:
        raise TableFormatError(f"{path} lacks meta.t0_unix (the rank's wall-clock step start), so it is no run dump")
    return part


def run_of(part: Timeline) -> tuple:
    return part.meta.get("run_id"), part.algorithm, part.pp, part.vpp, part.microbatches, part.time_unit


def describe_run(part: Timeline) -> str:
    run_id = part.meta.get("run_id")
    return (f"{part.algorithm} pp={part.pp} vpp={part.vpp} m={part.microbatches}"
            + (f" of run {run_id}" if run_id else " (no run id)"))
