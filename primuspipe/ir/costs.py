"""Per-stage compute times, the part of a cost model that algorithms may read.

Kept in the core (not the simulator) because cost-aware algorithms such as ``zb-auto`` take it as
input while staying free of the simulator; the simulator's full cost model embeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from primuspipe.errors import ConfigError


def _per_stage(name: str, value: float | Sequence[float], num_stages: int) -> tuple[float, ...]:
    values = (float(value),) * num_stages if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != num_stages:
        raise ConfigError(f"{name} has {len(values)} values but the pipeline has {num_stages} stages; "
                          "give one value for all stages or one per stage")
    if any(v < 0 for v in values):
        raise ConfigError(f"{name} times must be >= 0, got {values}")
    return values


@dataclass(frozen=True)
class ComputeCosts:
    """Time of each compute kind on each stage (any unit, used consistently)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]

    @classmethod
    def per_stage(
        cls, num_stages: int, f: float | Sequence[float], b: float | Sequence[float], w: float | Sequence[float]
    ) -> ComputeCosts:
        """One value for every stage, or a list with one value per stage."""
        return cls(_per_stage("F", f, num_stages), _per_stage("B", b, num_stages), _per_stage("W", w, num_stages))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def fused_backward(self, stage: int) -> float:
        return self.backward_input[stage] + self.backward_weight[stage]
