"""The schedule table: one ordered node list per rank, plus the shape and placement it was built for.

A table is an immutable value: algorithms return one, passes return new ones, the runner and the
simulator only read it. JSON is the lossless exchange format (``to_json``/``from_json``); the
torch.distributed.pipelining CSV format lives in :mod:`primuspipe.ir.formats`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from primuspipe.ir.dataflow import Transfer, Wiring
from primuspipe.ir.documents import check_envelope, envelope
from primuspipe.errors import TableFormatError
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ScheduleTable:
    placement: Placement
    microbatches: int
    ranks: tuple[tuple[ScheduleNode, ...], ...]
    algorithm: str = field(default="custom")
    """Name of the algorithm that built the table; informational only."""

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise TableFormatError(f"a schedule needs at least one microbatch, got {self.microbatches}")
        if len(self.ranks) != self.placement.pp:
            raise TableFormatError(
                f"table has {len(self.ranks)} rank lists but its placement has pp = {self.placement.pp}"
            )

    @classmethod
    def build(
        cls, placement: Placement, microbatches: int, ranks: Iterable[Iterable[ScheduleNode]], algorithm: str = "custom"
    ) -> ScheduleTable:
        return cls(placement, microbatches, tuple(tuple(r) for r in ranks), algorithm)

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

    def compute_only(self) -> ScheduleTable:
        return self.with_ranks(tuple(n for n in row if n.kind.is_compute) for row in self.ranks)

    def with_ranks(self, ranks: Iterable[Iterable[ScheduleNode]], wiring: Wiring | None = None) -> ScheduleTable:
        """This table's shape with other rows; ``wiring``, when the caller already knows the new rows'
        (see :meth:`Wiring.with_rows`), saves deriving it again."""
        table = ScheduleTable.build(self.placement, self.microbatches, ranks, self.algorithm)
        if wiring is not None:
            vars(table)["wiring"] = wiring  # the cached_property's slot
        return table

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
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> ScheduleTable:
        check_envelope(data, "primuspipe.schedule", FORMAT_VERSION, "schedule")
        try:
            placement = Placement.from_dict(data["placement"])
            ranks = [[ScheduleNode.parse(t) for t in row] for row in data["ranks"]]
            table = cls.build(placement, int(data["microbatches"]), ranks, str(data.get("algorithm", "custom")))
        except KeyError as exc:
            raise TableFormatError(f"schedule JSON lacks the field {exc}") from exc
        if (table.pp, table.vpp) != (data.get("pp", table.pp), data.get("vpp", table.vpp)):
            raise TableFormatError(f"schedule JSON says pp={data.get('pp')}, vpp={data.get('vpp')} but its placement disagrees")
        return table

    @classmethod
    def from_json(cls, text: str) -> ScheduleTable:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TableFormatError(f"schedule file is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

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

