"""Schedule shapes shared by several algorithms, so no algorithm copies another's loops."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from primuspipe import strict
from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.node import FB, B, F, ScheduleNode, W


@strict.arguments(error=ScheduleShapeError)
def warmup_steady_cooldown(
    forwards: Sequence[ScheduleNode], backwards: Sequence[ScheduleNode], warmup: int
) -> list[ScheduleNode]:
    """The 1F1B shape: ``warmup`` forwards, then one forward and one backward at a time, then the
    remaining backwards. Forwards and backwards keep their given orders. A plug-in calls it (docs/authoring.md):
    a warm-up past its forwards was a bare assert, and under ``python -O`` a row that lost backwards."""
    if len(forwards) != len(backwards) or not 0 <= warmup <= len(forwards):
        raise ScheduleShapeError(f"warmup_steady_cooldown takes as many backwards as forwards and a warmup of 0 to "
                                 f"their count, got {len(forwards)} forwards, {len(backwards)} backwards, "
                                 f"warmup={warmup}")
    steady = len(forwards) - warmup
    order = list(forwards[:warmup])
    for k in range(steady):
        order += [forwards[warmup + k], backwards[k]]
    return order + list(backwards[steady:])


def require(condition: bool, algorithm: str, message: str) -> None:
    """Refuse an impossible shape with the project's error."""
    if not condition:
        raise ScheduleShapeError(f"{algorithm}: {message}")


class RankProgram:
    """One rank's node list written phase by phase (DualPipe-V, the hand-crafted ZBV): the next
    microbatch per chunk and kind, and the weight gradients (W) deferred so far."""

    def __init__(self) -> None:
        self.nodes: list[ScheduleNode] = []
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.deferred: deque[tuple[int, int]] = deque()
        """(microbatch, chunk) of each deferred W, oldest first."""

    def _take(self, counters: list[int], chunk: int) -> int:
        counters[chunk] += 1
        return counters[chunk] - 1

    def forward(self, chunk: int) -> None:
        self.nodes.append(F(self._take(self.next_f, chunk), chunk))

    def _finish_backward(self, mb: int, chunk: int, zero_bubble: bool) -> None:
        if zero_bubble:
            self.deferred.append((mb, chunk))
        else:
            self.nodes.append(W(mb, chunk))

    def backward(self, chunk: int, *, zero_bubble: bool = False) -> None:
        """An input-grad B, then its W at once, or (``zero_bubble``) deferred."""
        mb = self._take(self.next_b, chunk)
        self.nodes.append(B(mb, chunk))
        self._finish_backward(mb, chunk, zero_bubble)

    def forward_backward(self, f_chunk: int, b_chunk: int) -> None:
        """Overlapped F of the next microbatch of ``f_chunk`` and full backward of ``b_chunk``'s."""
        f_mb = self._take(self.next_f, f_chunk)
        b_mb = self._take(self.next_b, b_chunk)
        self.nodes.append(FB(f_mb, f_chunk, b_mb, b_chunk))
        self._finish_backward(b_mb, b_chunk, zero_bubble=False)

    def weight(self, chunk: int | None = None) -> None:
        """The oldest deferred W (of ``chunk``, if given)."""
        entry = next(e for e in self.deferred if chunk is None or e[1] == chunk)
        self.deferred.remove(entry)
        self.nodes.append(W(*entry))
