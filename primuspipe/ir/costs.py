"""Per-stage compute times (the compute part of :class:`~primuspipe.ir.cost_model.CostModel`, which
algorithms and the simulator share), and the one parser of per-stage (or per-rank) values that every
cost input goes through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from primuspipe.errors import ConfigError
from primuspipe import strict
from primuspipe.ir.kinds import NodeKind, step_kind

Values = float | Sequence[float]
"""One value for every stage (or rank), or a list with one value each."""


def per_stage_values(name: str, value: Values, count: int, what: str = "stages") -> tuple[float, ...]:
    """``value`` as ``count`` finite numbers >= 0: one number repeated, or a list of exactly ``count``.

    ASCII number text is read as a number too (PyYAML reads ``1e9``, without a dot, as a string);
    booleans, NaN and infinity are refused (:mod:`primuspipe.strict`).

    >>> per_stage_values("F", 2, 3)
    (2.0, 2.0, 2.0)
    """
    if isinstance(value, (int, float, str)):
        values = (strict.number(value, name, minimum=0),) * count
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):  # b"hi" is no [104, 105]
        values = tuple(strict.number(v, f"{name}[{i}]", minimum=0) for i, v in enumerate(value))
    else:
        raise ConfigError(f"{name} must be a number or a list of numbers, got {strict.show(value)}")
    if len(values) != count:
        raise ConfigError(f"{name} has {len(values)} values but there are {count} {what}; "
                          f"give one value for all {what} or one per {what.rstrip('s')}")
    return values


@dataclass(frozen=True)
class ComputeCosts:
    """Time of each compute kind on each stage (any unit, used consistently), keyed by the kind's cost
    key in the kind table (:attr:`~primuspipe.ir.kinds.KindSpec.cost`): the split backward's three
    (``f``, ``b``, ``w``) are always given; any other timed kind (a plug-in's ``recompute``, say) brings
    its own in :attr:`other`, so a new kind that costs time needs no change here."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    other: tuple[tuple[str, tuple[float, ...]], ...] = ()
    """``(cost key, per-stage times)`` of the other timed kinds, by key."""

    def __post_init__(self) -> None:
        strict.fields(self)
        object.__setattr__(self, "other", tuple(sorted(self.other)))  # one model, one value
        if not self.forward:
            raise ConfigError("ComputeCosts.forward needs one time per stage, got none")
        fields = {"f": "forward", "b": "backward_input", "w": "backward_weight"}
        for key, values in self.times.items():
            name = f"compute.{key} (ComputeCosts.{fields.get(key, 'other')})"
            if len(values) != self.num_stages:
                raise ConfigError(f"{name} has {len(values)} values for {self.num_stages} stages")
            if not all(math.isfinite(t) and t >= 0 for t in values):
                raise ConfigError(f"{name} must be finite times >= 0, got {strict.show(values)}")

    @classmethod
    def per_stage(cls, num_stages: int, f: Values, b: Values, w: Values, **other: Values) -> ComputeCosts:
        """One value for every stage, or a list with one value per stage; ``other`` by cost key."""
        num_stages = strict.count(num_stages, "a cost model's number of stages", minimum=1)
        return cls(per_stage_values("F", f, num_stages), per_stage_values("B", b, num_stages),
                   per_stage_values("W", w, num_stages),
                   tuple((key, per_stage_values(key, v, num_stages)) for key, v in other.items()))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @cached_property
    def times(self) -> dict[str, tuple[float, ...]]:
        """Every kind's per-stage times, by cost key (derived once: the simulator asks per node)."""
        return {"f": self.forward, "b": self.backward_input, "w": self.backward_weight, **dict(self.other)}

    def map(self, change: Callable[[str, tuple[float, ...]], tuple[float, ...]]) -> ComputeCosts:
        """These costs with every key's times replaced by ``change(key, times)``."""
        new = {key: change(key, values) for key, values in self.times.items()}
        return ComputeCosts(new.pop("f"), new.pop("b"), new.pop("w"), tuple(new.items()))

    def __getstate__(self) -> dict:
        """Pickled without the caches (their keys are kinds, which may be gone where it is read)."""
        return {k: v for k, v in vars(self).items() if k not in ("times", "_resolved")}

    @cached_property
    def _resolved(self) -> dict[NodeKind, tuple[float, ...] | None]:
        return {}

    def get(self, kind: NodeKind) -> tuple[float, ...] | None:
        """Per-stage times of a single-part compute kind by its cost key; a kind these costs do not
        time that completes several steps costs the sum of the kinds completing each (BW: B + W);
        None if neither is known."""
        times = self.times
        if (own := times.get(kind.spec.cost)) is not None:
            return own
        if len(kind.completes) > 1:
            parts = [self.get(step_kind(step)) for step in kind.completes]
            if all(p is not None for p in parts):
                return tuple(map(sum, zip(*parts)))
        return None

    def of(self, kind: NodeKind) -> tuple[float, ...]:
        """:meth:`get`, or a ConfigError naming the missing cost key."""
        if (times := self._resolved.get(kind)) is None:
            times = self._resolved[kind] = self.get(kind)
        if times is None:
            raise ConfigError(f"the cost model has no times for {kind} nodes: add compute.{kind.spec.cost} to the cost "
                              f"file (it gives {', '.join(self.times)})")
        return times
