"""The schedule table: one ordered node list per rank, plus the shape and placement it was built for.

A table is an immutable value: algorithms return one, passes return new ones, the runner and the
simulator only read it. JSON is the lossless exchange format (``to_json``/``from_json``); the
torch.distributed.pipelining CSV format lives in :mod:`primuspipe.io.formats`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import InitVar, asdict, dataclass, field
from functools import cached_property

from primuspipe import strict
from primuspipe.ir.dataflow import Pairing, Transfer, Wiring
from primuspipe.documents import check_envelope, envelope
from primuspipe.errors import TableFormatError
from primuspipe.ir.limits import MAX_NODES, MOST_NODES_PER_STEP, check_shape
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement

FORMAT_VERSION = 1
_JSON_KEYS = {"format", "version", "algorithm", "pp", "vpp", "microbatches", "placement", "ranks", "construction"}

@dataclass(frozen=True)
class Construction:
    """Which of an algorithm's candidate constructions a table is, and what the simulator made of it
    under the costs the algorithm planned with (:mod:`primuspipe.algorithms.competition`)."""

    name: str
    """The construction chosen: the paper's (e.g. ``the paper's ZB-H1 pattern``) when the chosen table
    is exactly it, else the candidate that won (e.g. a greedy fill's policy)."""
    step_time: float
    """Its simulated step time, in the planning cost model's unit."""
    candidates: int
    """How many distinct candidate tables competed."""
    paper: str | None = None
    """The construction of the algorithm's paper, when it has one the code writes out."""
    paper_step_time: float | None = None
    """The paper's construction's simulated step time (None: it does not run at this shape)."""

    def __post_init__(self) -> None:
        times = [self.step_time] + ([] if self.paper_step_time is None else [self.paper_step_time])
        if not all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in times) or self.candidates < 1:
            raise TableFormatError(f"a construction needs finite step times >= 0 and a candidate count >= 1, got {self}")

    def __str__(self) -> str:
        """One line for people: what was chosen, at what simulated step, against what."""
        line = f"{self.name}, simulated step {self.step_time:g} (best of {self.candidates} " \
               f"candidate{'s' if self.candidates > 1 else ''})"
        if self.paper is not None and self.paper != self.name:
            paper = "does not run at this shape" if self.paper_step_time is None else f"{self.paper_step_time:g}"
            line += f"; {self.paper}: {paper}"
        return line

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object, source: str) -> Construction:
        where = f"{source}: construction"
        data = strict.keys(data, where, {"name", "step_time", "candidates", "paper", "paper_step_time"},
                           required={"name", "step_time", "candidates"}, error=TableFormatError)
        paper, paper_time = data.get("paper"), data.get("paper_step_time")
        return cls(strict.text(data["name"], f"{where}.name", error=TableFormatError),
                   strict.number(data["step_time"], f"{where}.step_time", minimum=0, error=TableFormatError),
                   strict.count(data["candidates"], f"{where}.candidates", minimum=1, error=TableFormatError),
                   None if paper is None else strict.text(paper, f"{where}.paper", error=TableFormatError),
                   None if paper_time is None else strict.number(paper_time, f"{where}.paper_step_time", minimum=0,
                                                                 error=TableFormatError))


@dataclass(frozen=True)
class ScheduleTable:
    placement: Placement
    microbatches: int
    ranks: tuple[tuple[ScheduleNode, ...], ...]
    algorithm: str = field(default="custom")
    """Name of the algorithm that built the table; informational only."""
    construction: Construction | None = field(default=None, compare=False)
    """For an algorithm that chooses among constructions, which one this is and its simulated step
    (informational: not part of the table's identity, kept by the passes)."""
    known_wiring: InitVar[Wiring | None] = None
    """The rows' :attr:`wiring` where the caller already has it (a pass that knows how its rows moved,
    :meth:`Wiring.with_rows`); None derives it on first use. Not part of the table's value."""

    def __post_init__(self, known_wiring: Wiring | None) -> None:
        strict.instance(self.placement, Placement, "a table's placement", error=TableFormatError)
        if type(self.ranks) is not tuple or any(type(row) is not tuple for row in self.ranks):
            object.__setattr__(self, "ranks", _rows(self.ranks))  # hashed and shared: tuples, as build makes them
        if self.construction is not None:
            strict.instance(self.construction, Construction, "a table's construction", error=TableFormatError)
        strict.text(self.algorithm, "a table's algorithm name", error=TableFormatError)
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise TableFormatError(f"a schedule needs an integer count of microbatches >= 1, got {self.microbatches!r}")
        check_shape(self.pp, self.vpp, self.microbatches)
        if len(self.ranks) != self.placement.pp:
            raise TableFormatError(
                f"table has {len(self.ranks)} rank lists but its placement has pp = {self.placement.pp}"
            )
        if (total := sum(map(len, self.ranks))) > (most := MOST_NODES_PER_STEP * self.num_stages * self.microbatches):
            raise TableFormatError(f"the table holds {total:,} nodes, more than the {most:,} any table of "
                                   f"pp={self.pp}, vpp={self.vpp} and {self.microbatches} microbatches has; "
                                   "nodes are repeated")
        if {type(n) for row in self.ranks for n in row} - {ScheduleNode}:  # one pass at C speed; found below
            rank, index, entry = next((r, i, n) for r, row in enumerate(self.ranks) for i, n in enumerate(row)
                                      if type(n) is not ScheduleNode)
            raise TableFormatError(f"rank {rank} entry {index} is {entry!r:.60}, not a schedule node; build "
                                   "rows of F(mb, chunk), B, W, BW, FB nodes (primuspipe.ir.node)")
        if known_wiring is not None:  # a cached_property keeps its value in the instance dict: seed it
            self.__dict__["wiring"] = known_wiring

    def __hash__(self) -> int:
        """Computed once per table: hashing walks every node, and tables key caches (the proof, the
        resource plan per rank) that a large table is looked up in once per rank."""
        if (cached := vars(self).get("_hash")) is None:
            cached = vars(self)["_hash"] = hash((self.placement, self.microbatches, self.ranks, self.algorithm))
        return cached

    def __getstate__(self) -> dict:
        """Pickled without the cached hash: string hashes differ between processes."""
        return {k: v for k, v in vars(self).items() if k != "_hash"}

    @classmethod
    def build(
        cls, placement: Placement, microbatches: int, ranks: Iterable[Iterable[ScheduleNode]], algorithm: str = "custom"
    ) -> ScheduleTable:
        return cls(placement, microbatches, _rows(ranks), algorithm)

    @property
    def pp(self) -> int:
        return self.placement.pp

    @property
    def vpp(self) -> int:
        return self.placement.vpp

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @cached_property
    def has_communication(self) -> bool:
        """True if the table has SEND/RECV nodes (derived once: passes ask for every node)."""
        return any(not n.kind.is_compute for row in self.ranks for n in row)

    @cached_property
    def splits_backward(self) -> bool:
        """True if some node runs half of a backward, its input grad or its weight grad alone (``B``,
        ``W``, or an overlapped node with such a part): the backends then keep weight grads deferred."""
        return any(k.is_input_grad != k.is_weight_grad for row in self.ranks for n in row for k, _, _ in n.parts())

    def compute_only(self) -> ScheduleTable:
        return self.with_ranks(tuple(n for n in row if n.kind.is_compute) for row in self.ranks)

    def with_ranks(self, ranks: Iterable[Iterable[ScheduleNode]], wiring: Wiring | None = None) -> ScheduleTable:
        """This table's shape with other rows; ``wiring``, when the caller already knows the new rows'
        (see :meth:`Wiring.with_rows`), saves deriving it again."""
        return ScheduleTable(self.placement, self.microbatches, tuple(tuple(r) for r in ranks), self.algorithm,
                             self.construction, wiring)

    @cached_property
    def transfers(self) -> tuple[tuple[Transfer | None, ...], ...]:
        """Per rank and node: the transfer a communication node moves, None for compute nodes.

        Derived once per table (passes look it up for every node); the table must name existing chunks
        (:func:`~primuspipe.passes.validation.check_structure`)."""
        transfer = self.wiring.transfer
        return tuple(tuple(None if k < 0 else transfer(k) for k in moves) for moves in self.wiring.moves)

    @cached_property
    def wiring(self) -> Wiring:
        """The table's transfers as integers (:class:`~primuspipe.ir.dataflow.Wiring`), derived once;
        the table must name existing chunks."""
        return Wiring(self.placement, self.microbatches, self.ranks)

    @cached_property
    def pairing(self) -> Pairing:
        """Which receive each send meets (:class:`~primuspipe.ir.dataflow.Pairing`), compiled once for the
        validator's pairing rule and deadlock replay and the simulator's streams."""
        return Pairing(self.ranks, self.wiring)

    def positions(self) -> Iterator[tuple[int, int, ScheduleNode]]:
        """Every ``(rank, index, node)`` in rank order."""
        for r, row in enumerate(self.ranks):
            for i, node in enumerate(row):
                yield r, i, node

    # -- JSON ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            **envelope("primuspipe.schedule", FORMAT_VERSION),
            "algorithm": self.algorithm,
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.microbatches,
            "placement": self.placement.to_dict(),
            "ranks": [[str(n) for n in row] for row in self.ranks],
            **({} if self.construction is None else {"construction": self.construction.to_dict()}),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict, source: str = "schedule JSON") -> ScheduleTable:
        """The table of a parsed JSON document, checked field by field (``source`` names it in errors)."""
        check_envelope(data, "primuspipe.schedule", FORMAT_VERSION, "schedule", source)
        data = strict.keys(data, source, _JSON_KEYS, required={"placement", "microbatches", "ranks"},
                           error=TableFormatError)
        m = strict.count(data["microbatches"], f"{source}: microbatches", minimum=1, error=TableFormatError)
        placement = Placement.from_dict(data["placement"], f"{source}: placement")
        for key, value in (("pp", placement.pp), ("vpp", placement.vpp)):
            if key in data and strict.count(data[key], f"{source}: {key}", error=TableFormatError) != value:
                raise TableFormatError(f"{source}: {key} is {data[key]} but the placement has {key}={value}; "
                                       "fix one of them")
        check_shape(placement.pp, placement.vpp, m)
        rows = data["ranks"]
        if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
            raise TableFormatError(f"{source}: ranks must be a list with one list of node texts per rank")
        if (total := sum(map(len, rows))) > MAX_NODES:
            raise TableFormatError(f"{source}: {total:,} nodes, more than the {MAX_NODES:,} a table may have")
        if len(rows) != placement.pp:
            raise TableFormatError(f"{source}: ranks has {len(rows)} rows but the placement has pp={placement.pp}")
        algorithm = strict.text(data.get("algorithm", "custom"), f"{source}: algorithm", error=TableFormatError)
        construction = None if data.get("construction") is None else Construction.from_dict(data["construction"], source)
        return cls(placement, m, tuple(tuple(_parse_node(t, source, r, i) for i, t in enumerate(row))
                                       for r, row in enumerate(rows)), algorithm, construction)

    @classmethod
    def from_json(cls, text: str, source: str = "schedule JSON") -> ScheduleTable:
        return cls.from_dict(strict.load_json(text, source, error=TableFormatError), source)

    # -- text ---------------------------------------------------------------------------------------
    def grid(self, marks: Sequence[tuple[int, int]] = (), compute_only: bool = False) -> str:
        """Plain-text grid, one line per rank; nodes at ``marks`` ((rank, index)) are shown ``>>NODE<<``."""
        return render_grid(self, marks, compute_only)

    def compact_grid(self) -> str:
        """The compute order in the papers' shorthand, for docstrings: ``F3`` is microbatch 3's forward
        on chunk 0, ``f3`` on chunk 1 (vpp = 2; a larger vpp keeps the full text form), ``F3+b1`` an
        overlapped pair.

        >>> from primuspipe.ir.node import F, BW
        >>> print(ScheduleTable.build(Placement.interleaved(1, 2), 1, [[F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)]]).compact_grid())
        rank 0 | F0 f0 bw0 BW0
        """
        def cell(node: ScheduleNode) -> str:
            if self.vpp > 2:
                return str(node)
            return "+".join(f"{k.name.lower() if c else k.name}{mb}" for k, mb, c in node.parts())

        return "\n".join(f"rank {r} | " + " ".join(cell(n) for n in row if n.kind.is_compute)
                         for r, row in enumerate(self.ranks))

    def __str__(self) -> str:
        return self.grid()


def _rows(ranks: object) -> tuple[tuple[ScheduleNode, ...], ...]:
    """A table's rows, given as any iterable of iterables (a list of lists, a generator), as tuples."""
    rows = tuple(strict.instance(ranks, Iterable, "a table's rows", error=TableFormatError))
    if flat := next((row for row in rows if not isinstance(row, Iterable)), None):
        raise TableFormatError(f"a table's rows are one list of nodes per rank, but one row is a {type(flat).__name__} "
                               f"({flat!s:.40}); pass [[nodes of rank 0], [nodes of rank 1], ...]")
    return tuple(tuple(r) for r in rows)


def _parse_node(text: object, source: str, rank: int, index: int) -> ScheduleNode:
    if not isinstance(text, str):
        raise TableFormatError(f"{source}: rank {rank} node {index} must be a node text such as F3.1, got {text!r}")
    try:
        return ScheduleNode.parse(text)
    except TableFormatError as exc:
        raise TableFormatError(f"{source}: rank {rank} node {index}: {exc}") from None


def render_grid(table: ScheduleTable, marks: Sequence[tuple[int, int]] = (), compute_only: bool = False) -> str:
    marked = set(marks)
    cells = [
        [f">>{n}<<" if (r, i) in marked else str(n) for i, n in enumerate(row) if not compute_only or n.kind.is_compute or (r, i) in marked]
        for r, row in enumerate(table.ranks)
    ]
    width = max((len(c) for row in cells for c in row), default=1)
    head = f"{table.algorithm}: pp={table.pp} vpp={table.vpp} microbatches={table.microbatches} placement={table.placement.name}"
    lines = [head] + [f"rank {r:>2} | " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(cells)]
    return "\n".join(lines)

