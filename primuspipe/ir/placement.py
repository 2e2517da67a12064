"""Where each model stage lives: the (rank, chunk) <-> stage map, kept as data on the table.

The model has ``S = pp * vpp`` stages, each a contiguous slice of layers; rank ``r`` holds ``vpp`` of
them as its chunks. Two layouts are built in (docs/design.md §2):

* interleaved ("loop"): stage = chunk * pp + rank — Megatron's virtual pipeline;
* V-shape (vpp = 2): chunk 0 is stage ``rank``, chunk 1 is stage ``2*pp - 1 - rank``, so the first and
  last stage share rank 0 and stages ``pp-1``/``pp`` hand off locally on rank ``pp-1``.

Any other bijection can be given explicitly (``Placement("custom", stages)``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from primuspipe.errors import TableFormatError
from primuspipe import strict
from primuspipe.ir.limits import check_shape


@dataclass(frozen=True)
class Placement:
    name: str = field(compare=False)
    """The layout's name, for people; two placements are equal when they map stages the same way (at
    pp = 1 the V-shape and the interleaved layout coincide)."""
    stages: tuple[tuple[int, ...], ...]
    """``stages[rank][chunk]`` is the global stage index of that chunk."""

    def __post_init__(self) -> None:
        if not self.stages or not self.stages[0]:
            raise TableFormatError("a placement needs at least one rank with one chunk")
        vpp = len(self.stages[0])
        if any(len(row) != vpp for row in self.stages):
            raise TableFormatError(f"every rank must hold the same number of chunks: {strict.show(self.stages)}")
        flat = sorted(s for row in self.stages for s in row)
        if flat != list(range(len(flat))):
            raise TableFormatError(
                f"placement {self.name!r} must map ranks x chunks one-to-one onto stages 0..{len(flat) - 1}, "
                f"got {strict.show(self.stages)}"
            )

    @classmethod
    def interleaved(cls, pp: int, vpp: int = 1) -> Placement:
        pp, vpp = (strict.count(v, f"an interleaved placement's {name}", minimum=1, error=TableFormatError)
                   for name, v in (("pp", pp), ("vpp", vpp)))
        check_shape(pp, vpp, 1)
        return cls("interleaved", tuple(tuple(c * pp + r for c in range(vpp)) for r in range(pp)))

    @classmethod
    def vshape(cls, pp: int) -> Placement:
        pp = strict.count(pp, "a V-shape placement's pp", minimum=1, error=TableFormatError)
        check_shape(pp, 2, 1)
        return cls("v", tuple((r, 2 * pp - 1 - r) for r in range(pp)))

    @classmethod
    def named(cls, name: str, pp: int, vpp: int) -> Placement:
        """The built-in layout called ``name`` ("interleaved" or "v")."""
        if name == "interleaved":
            return cls.interleaved(pp, vpp)
        if name == "v":
            if vpp != 2:
                raise TableFormatError(f"the V-shape placement needs vpp = 2, got vpp = {vpp}")
            return cls.vshape(pp)
        raise TableFormatError(f"unknown placement {name!r}; built-in ones are 'interleaved' and 'v'")

    @classmethod
    def shown_by(cls, pp: int, vpp: int, forwarded_from_rank_0: Iterable[int]) -> Placement:
        """The built-in layout a table's communication shows, for records that name none: with 2 chunks per
        rank, rank 0 hands an activation on from its chunk 1 only in the interleaved layout (in the V its
        chunk 1 is the last stage); any other vpp is interleaved. ``forwarded_from_rank_0``: the chunks rank
        0 sends activations from (none where the table has no communication: then 2 chunks are ambiguous,
        which the caller says if it matters)."""
        return cls.named("v" if vpp == 2 and 1 not in set(forwarded_from_rank_0) else "interleaved", pp, vpp)

    @cached_property
    def pp(self) -> int:
        return len(self.stages)

    @cached_property
    def vpp(self) -> int:
        return len(self.stages[0])

    @cached_property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        return self.stages[rank][chunk]

    def locate(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding ``stage``."""
        return self._where[stage]

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {s: (r, c) for r, row in enumerate(self.stages) for c, s in enumerate(row)}

    def rank_of(self, stage: int) -> int:
        return self._where[stage][0]

    def to_dict(self) -> dict:
        return {"name": self.name, "stages": [list(row) for row in self.stages]}

    @classmethod
    def from_dict(cls, data: dict, source: str = "placement") -> Placement:
        """A placement from its JSON form (``source`` names it in errors)."""
        data = strict.keys(data, source, {"name", "stages"}, required={"name", "stages"}, error=TableFormatError)
        rows = data["stages"]
        if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
            raise TableFormatError(f"{source}: stages must be a list with one list of stage numbers per rank")
        name = strict.text(data["name"], f"{source}: name", error=TableFormatError)
        stages = tuple(tuple(strict.count(s, f"{source}: stages[{r}][{c}]", error=TableFormatError)
                             for c, s in enumerate(row)) for r, row in enumerate(rows))
        try:
            placement = cls(name, stages)
            # a built-in name promises its layout: the stages must be it
            promised = cls.named(name, placement.pp, placement.vpp).stages if name in ("interleaved", "v") else stages
        except TableFormatError as exc:
            raise TableFormatError(f"{source}: {exc}") from None
        if promised != placement.stages:
            raise TableFormatError(f"{source}: the name {name!r} contradicts its stages {strict.show(rows)} "
                                   f"({name!r} is {strict.show([list(r) for r in promised])}); fix the name or "
                                   "the stages")
        return placement

    @classmethod
    def infer(cls, stages_per_rank: list[list[int]]) -> Placement:
        """Placement from the stages seen on each rank (chunks in ascending stage order), named after
        the built-in layout it matches."""
        stages = tuple(tuple(sorted(set(row))) for row in stages_per_rank)
        pp, vpp = len(stages), len(stages[0]) if stages else 0
        for candidate in ("interleaved", "v"):
            try:
                built = cls.named(candidate, pp, vpp)
            except TableFormatError:
                continue
            if tuple(tuple(sorted(row)) for row in built.stages) == stages:
                return built
        return cls("custom", stages)
