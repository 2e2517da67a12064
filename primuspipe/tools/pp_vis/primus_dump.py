"""Primus's dumps as timelines: its training runs' ``dump_pp_data`` and its pipeline simulator's output.

Both are a folder with a ``config.json`` and one ``pp_rank_<r>.json`` per pipeline rank (docs/primus.md):

* ``config.json`` -- a run writes ``pp_size``, ``vp_size``, ``num_mbs`` (and world, dp, tp, ep sizes,
  ``train_iters``); the simulator writes ``pp_size``, ``vpp_size``, ``micro_batches``;
* ``pp_rank_<r>.json`` -- keyed by iteration (a run from ``"1"``, the simulator ``"0"``), each holding
  ``total`` (the rank's step time), ``memory`` and, per series ``fwd``, ``bwd`` and ``wgrad``, the lists
  ``<series>_start`` / ``<series>_end`` (ms from the step's start) and ``<series>_minibatch`` /
  ``<series>_chunk`` (empty in runs of Megatron's own schedules, which time only forward and backward).

A ``fwd`` event is an F node, a ``wgrad`` event a W, a ``bwd`` event a B when the rank has ``wgrad``
events and a fused BW when it has none. An F and a B timed as one interval (Primus's overlapped
forward-backward) are one FB node. Without minibatch and chunk lists the k-th event of a series is
the k-th of Megatron's own order (1F1B, or interleaved 1F1B at vpp > 1). A run's ``memory`` is GiB
(peak reserved); the simulator's counts activations (1F1B-stage microbatches), which has no byte
value and goes to ``meta``. The placement is not recorded: at vpp = 2 the rank that runs the first
chunk-1 forward tells the V (the last rank) from the interleaved layout (rank 0).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import TableFormatError
from primuspipe import strict
from primuspipe.ir.kinds import NodeKind, overlapped_kind, split_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.io.timeline import RankTimeline, TimedNode, Timeline

CONFIG = "config.json"
GIB = 1024 ** 3
SERIES = ("fwd", "bwd", "wgrad")


def is_primus_dump(path: Path) -> bool:
    """Whether ``path`` is a folder in Primus's dump layout."""
    return path.is_dir() and (path / CONFIG).is_file() and (path / "pp_rank_0.json").is_file()


def primus_dumps_under(path: Path) -> list[Path]:
    """The Primus dump folders directly under ``path`` (a Primus simulator's ``output_dir``)."""
    return sorted(p for p in path.iterdir() if is_primus_dump(p)) if path.is_dir() else []


def load_primus_iterations(path: Path) -> list[Timeline]:
    """Every iteration of a Primus dump folder, oldest first."""
    dump = _PrimusDump(path)
    return [dump.timeline(i) for i in dump.iterations]


def load_primus_dump(path: Path, iteration: int | None = None) -> Timeline:
    """One iteration (default: the last, the warmest) of a Primus dump folder."""
    dump = _PrimusDump(path)
    if iteration is not None and iteration not in dump.iterations:
        raise TableFormatError(f"{path} has no iteration {iteration}; it holds {dump.iterations}")
    return dump.timeline(dump.iterations[-1] if iteration is None else iteration)


class _PrimusDump:
    def __init__(self, path: Path):
        self.path = path
        config = _read_json(path / CONFIG)
        self.simulated = "micro_batches" in config
        self.pp = _positive_int(config, "pp_size", path / CONFIG)
        self.vpp = _positive_int(config, "vpp_size" if self.simulated else "vp_size", path / CONFIG)
        self.microbatches = _positive_int(config, "micro_batches" if self.simulated else "num_mbs", path / CONFIG)
        self.ranks = [_read_json(path / f"pp_rank_{r}.json") for r in range(self.pp)]
        per_rank = [{_iteration(k, path / f"pp_rank_{r}.json") for k in data} for r, data in enumerate(self.ranks)]
        self.iterations = sorted(set.intersection(*per_rank))
        if not self.iterations:
            raise TableFormatError(f"{path}: no iteration is in every pp_rank_<r>.json (they hold "
                                   f"{[sorted(s) for s in per_rank]})")
        self._megatron_order: dict[int, dict[str, list[tuple[int, int]]]] | None = None

    def timeline(self, iteration: int) -> Timeline:
        ranks = tuple(RankTimeline(r, self._events(r, iteration), self._peak_bytes(r, iteration)) for r in range(self.pp))
        placement = self._placement(ranks)
        meta: dict[str, Any] = {"origin": "primus simulator" if self.simulated else "primus dump_pp_data",
                                "placement": placement.to_dict()}
        if self.simulated:
            meta["activation_peaks"] = [self._record(r, iteration).get("memory") for r in range(self.pp)]
        algorithm = self.path.name if self.simulated else "primus"
        return Timeline("simulator" if self.simulated else "run", algorithm, self.pp, self.vpp, self.microbatches,
                        ranks, iteration, "ms", meta).check_one_step(f"{self.path} iteration {iteration}")

    def _record(self, rank: int, iteration: int) -> dict:
        record = self.ranks[rank][str(iteration)]
        if not isinstance(record, dict):
            raise TableFormatError(f"{self._file(rank)}: iteration {iteration} must be a mapping of lists")
        return record

    def _file(self, rank: int) -> Path:
        return self.path / f"pp_rank_{rank}.json"

    def _peak_bytes(self, rank: int, iteration: int) -> int | None:
        memory = self._record(rank, iteration).get("memory")
        if self.simulated or memory is None:
            return None
        what = f"{self._file(rank)} iteration {iteration} memory"
        return int(_finite(_finite(memory, what) * GIB, f"{what} in bytes"))

    def _events(self, rank: int, iteration: int) -> tuple[TimedNode, ...]:
        record = self._record(rank, iteration)
        where = f"{self._file(rank)} iteration {iteration}"
        series = {name: self._series(record, name, rank, where) for name in SERIES}
        kinds = dict(zip(("fwd", "bwd", "wgrad"), split_kinds()))  # a split backward's three series, in order
        if not series["wgrad"]:
            kinds["bwd"] = NodeKind.BW
        timed = {name: [(start, end, kinds[name], mb, chunk) for start, end, mb, chunk in events]
                 for name, events in series.items()}
        weights = [TimedNode(ScheduleNode(kind, mb, chunk), start, end) for start, end, kind, mb, chunk in timed["wgrad"]]
        return tuple(sorted(_pair_overlapped(timed["fwd"], timed["bwd"]) + weights, key=lambda e: e.start))

    def _series(self, record: dict, name: str, rank: int, where: str) -> list[tuple[float, float, int, int]]:
        starts, ends = (_numbers(record.get(f"{name}_{edge}", []), f"{where} {name}_{edge}") for edge in ("start", "end"))
        labels = [record.get(f"{name}_{key}") or [] for key in ("minibatch", "chunk")]
        if len(starts) != len(ends):
            raise TableFormatError(f"{where}: {name}_start has {len(starts)} entries but {name}_end {len(ends)}")
        if (bad := next((i for i, (s, e) in enumerate(zip(starts, ends)) if e < s), None)) is not None:
            raise TableFormatError(f"{where}: {name} event {bad} ends before it starts ({starts[bad]} > {ends[bad]})")
        if not starts:
            return []
        if not labels[0]:
            labels = self._megatron_labels(rank, name, len(starts), where)
        elif not labels[1] and self.vpp == 1:
            labels[1] = [0] * len(labels[0])
        if any(len(ls) != len(starts) for ls in labels):
            raise TableFormatError(f"{where}: {name}_minibatch / {name}_chunk must have one entry per event "
                                   f"({len(starts)}), got {len(labels[0])} / {len(labels[1])}")
        for mb, chunk in zip(*labels):
            if not (isinstance(mb, int) and 0 <= mb < self.microbatches and isinstance(chunk, int) and 0 <= chunk < self.vpp):
                raise TableFormatError(f"{where}: {name} event of microbatch {mb!r}, chunk {chunk!r} is outside "
                                       f"{self.microbatches} microbatches x {self.vpp} chunks (config.json)")
        return list(zip(starts, ends, *labels))

    def _megatron_labels(self, rank: int, name: str, count: int, where: str) -> list[list[int]]:
        """(microbatch, chunk) of the k-th event of a series in Megatron's own order, for dumps without them."""
        if self._megatron_order is None:
            algorithm = "1f1b" if self.vpp == 1 else "interleaved-1f1b"
            table = build_schedule(algorithm, self.pp, self.microbatches, self.vpp, communication=False)
            self._megatron_order = {
                r: {"fwd": [(n.microbatch, n.chunk) for n in row if n.kind is NodeKind.F],
                    "bwd": [(n.microbatch, n.chunk) for n in row if n.kind is NodeKind.BW]}
                for r, row in enumerate(table.ranks)}
        order = self._megatron_order[rank].get(name, [])
        if len(order) != count:
            raise TableFormatError(f"{where}: {count} {name} events without {name}_minibatch/{name}_chunk, but "
                                   f"Megatron's own schedule runs {len(order)} on rank {rank}; label them")
        return [[mb for mb, _ in order], [chunk for _, chunk in order]]

    def _placement(self, ranks: tuple[RankTimeline, ...]) -> Placement:
        if self.vpp != 2 or self.pp == 1:
            return Placement.interleaved(self.pp, self.vpp)
        first_chunk1 = [(e.start, rt.rank) for rt in ranks for e in rt.events
                        for kind, mb, chunk in e.node.parts() if kind is NodeKind.F and (mb, chunk) == (0, 1)]
        if not first_chunk1:
            raise TableFormatError(f"{self.path}: no forward of microbatch 0 on chunk 1, so the stage layout is unknown")
        return Placement.vshape(self.pp) if min(first_chunk1)[1] == self.pp - 1 else Placement.interleaved(self.pp, 2)


def _pair_overlapped(forwards: list, backwards: list) -> list[TimedNode]:
    """F and B (or BW) events timed as one interval become one overlapped node; the rest stay single."""
    by_interval = {(start, end): (kind, mb, chunk) for start, end, kind, mb, chunk in backwards}
    events, paired = [], set()
    for start, end, kind, mb, chunk in forwards:
        if (back := by_interval.get((start, end))) is not None and end > start:
            paired.add((start, end))
            pair = overlapped_kind((kind, back[0]))
            events.append(TimedNode(ScheduleNode(pair, mb, chunk, pair=(back[1], back[2])), start, end))
        else:
            events.append(TimedNode(ScheduleNode(kind, mb, chunk), start, end))
    events += [TimedNode(ScheduleNode(kind, mb, chunk), start, end)
               for start, end, kind, mb, chunk in backwards if (start, end) not in paired]
    return events


def _read_json(path: Path) -> dict:
    """One file of the dump, read strictly (duplicate keys, nesting, integers of thousands of digits refused) but
    with NaN: Primus writes its dumps with Python's json, which spells a bad time as NaN, and reading it lets the
    error name the field that holds it."""
    if not path.exists():
        raise TableFormatError(f"{path} is missing; a Primus dump folder holds config.json and pp_rank_<r>.json for "
                               "every pipeline rank")
    data = strict.load_json(strict.read_text(path, "Primus dump file", error=TableFormatError), str(path),
                            error=TableFormatError, constants=True)
    if not isinstance(data, dict):
        raise TableFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _positive_int(config: dict, key: str, path: Path) -> int:
    return strict.count(config.get(key), f"{path}: {key!r}", error=TableFormatError, minimum=1)


_ITERATION_KEY = re.compile(r"0|[1-9][0-9]{0,17}", re.ASCII)


def _iteration(key: str, path: Path) -> int:
    """An iteration key as Primus writes it (``str(i)``): ``01``, `` 1``, ``+1`` or ``1_0`` would read as an
    iteration whose record is under another key."""
    if not _ITERATION_KEY.fullmatch(key):
        raise TableFormatError(f"{path}: key {strict.show(key)} is not an iteration number (0, 1, 2, ...)")
    return int(key)


def _finite(value: Any, what: str) -> float:
    if isinstance(value, str):  # JSON text is no time, though strict.number reads ASCII number text
        raise TableFormatError(f"{what} must be a finite number, got {strict.show(value)}")
    return strict.number(value, what, error=TableFormatError)


def _numbers(values: Any, what: str) -> list[float]:
    if not isinstance(values, list):
        raise TableFormatError(f"{what} must be a list of numbers, got {type(values).__name__}")
    numbers = [_finite(v, f"{what}[{i}]") for i, v in enumerate(values)]
    if (bad := next((i for i, v in enumerate(numbers) if v < 0), None)) is not None:
        raise TableFormatError(f"{what}[{bad}] is {numbers[bad]}; times are from the step's start, >= 0")
    return numbers
