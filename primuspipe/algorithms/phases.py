"""Schedule shapes shared by several algorithms, so no algorithm copies another's loops."""

from __future__ import annotations

from collections.abc import Sequence

from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.node import ScheduleNode


def warmup_steady_cooldown(
    forwards: Sequence[ScheduleNode], backwards: Sequence[ScheduleNode], warmup: int
) -> list[ScheduleNode]:
    """The 1F1B shape: ``warmup`` forwards, then one forward and one backward at a time, then the
    remaining backwards. Forwards and backwards keep their given orders."""
    assert len(forwards) == len(backwards) and 0 <= warmup <= len(forwards)
    steady = len(forwards) - warmup
    order = list(forwards[:warmup])
    for k in range(steady):
        order += [forwards[warmup + k], backwards[k]]
    return order + list(backwards[steady:])


def require(condition: bool, algorithm: str, message: str) -> None:
    """Refuse an impossible shape with the project's error."""
    if not condition:
        raise ScheduleShapeError(f"{algorithm}: {message}")
