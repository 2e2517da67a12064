"""Per-stage compute times (the compute part of :class:`~primuspipe.ir.cost_model.CostModel`, which
algorithms and the simulator share), and the one parser of per-stage (or per-rank) values that every
cost input goes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from primuspipe.errors import ConfigError
from primuspipe import strict
from primuspipe.ir.kinds import NodeKind

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
    elif isinstance(value, Sequence):
        values = tuple(strict.number(v, f"{name}[{i}]", minimum=0) for i, v in enumerate(value))
    else:
        raise ConfigError(f"{name} must be a number or a list of numbers, got {strict.show(value)}")
    if len(values) != count:
        raise ConfigError(f"{name} has {len(values)} values but there are {count} {what}; "
                          f"give one value for all {what} or one per {what.rstrip('s')}")
    return values


@dataclass(frozen=True)
class ComputeCosts:
    """Time of each compute kind on each stage (any unit, used consistently)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]

    @classmethod
    def per_stage(cls, num_stages: int, f: Values, b: Values, w: Values) -> ComputeCosts:
        """One value for every stage, or a list with one value per stage."""
        return cls(per_stage_values("F", f, num_stages), per_stage_values("B", b, num_stages),
                   per_stage_values("W", w, num_stages))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def fused_backward(self, stage: int) -> float:
        return self.backward_input[stage] + self.backward_weight[stage]

    def of(self, kind: NodeKind) -> tuple[float, ...]:
        """Per-stage times of a single-part compute kind, by its cost key in the kind table (BW: B + W)."""
        key = kind.spec.cost
        if key == "bw":
            return tuple(map(self.fused_backward, range(self.num_stages)))
        times = {"f": self.forward, "b": self.backward_input, "w": self.backward_weight}
        if key not in times:
            raise ConfigError(f"compute costs have no {key!r} times for {kind} nodes; they give f, b, w (and bw)")
        return times[key]
