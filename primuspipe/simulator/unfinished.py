"""What the simulator says when a step never finishes: which rank waits for what, and the cycle of waits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from primuspipe.errors import SimulationError
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.streams import Semantics, replay
from primuspipe.simulator import host_copies
from primuspipe.simulator.program import Program
from primuspipe.simulator.transport import StreamClock


def check_finished(table: ScheduleTable, programs: Sequence[Program], at: Sequence[int],
                   waiting: Mapping[int, int], streams: StreamClock, semantics: Semantics) -> None:
    """Refuse a step some rank or transfer never finished (``at[r]``: the op rank ``r`` stopped at;
    ``waiting``: key -> the rank blocked on it), with the validator's cycle of waits."""
    stuck = [r for r in range(len(programs)) if at[r] < len(programs[r].ops)]
    unfinished = streams.incomplete()
    if not stuck and not unfinished:
        return
    blocked = {r: host_copies.describe_key(k, table) if k < 0 else table.wiring.transfer(k) for k, r in waiting.items()}
    lines = [f"rank {r} at node {at[r]} ({table.ranks[r][at[r]]}) waits for the {blocked[r]}" for r in stuck]
    lines += [f"rank {r} node {i} ({table.ranks[r][i]}) never completes" for r, i in unfinished[:3] if r not in stuck]
    hang = replay(table, semantics)
    cycle = "" if hang is None else " The operations wait on each other in a cycle: " + "; ".join(hang.chain) + "."
    raise SimulationError(f"the table cannot complete under the {semantics.name} transport semantics; "
                          + "; ".join(lines) + "." + cycle + " Run validate(table, semantics="
                          f"{semantics.name!r}) or `primuspipe validate FILE --semantics {semantics.name}` on the "
                          "exported table for the full diagnosis.")
