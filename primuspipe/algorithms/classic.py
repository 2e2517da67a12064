"""GPipe, 1F1B and Megatron's interleaved 1F1B: the schedules with a fused backward (BW)."""

from __future__ import annotations

from primuspipe.algorithms.phases import require, warmup_steady_cooldown
from primuspipe.algorithms.registry import ScheduleRequest, register
from primuspipe.ir.node import BW, F
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable


@register("gpipe")
def gpipe(req: ScheduleRequest) -> ScheduleTable:
    """GPipe: every forward, then every backward; holds all microbatches' activations.

    Its compute order at pp=4, m=4 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 BW0 BW1 BW2 BW3
        rank 1 | F0 F1 F2 F3 BW0 BW1 BW2 BW3
        rank 2 | F0 F1 F2 F3 BW0 BW1 BW2 BW3
        rank 3 | F0 F1 F2 F3 BW0 BW1 BW2 BW3
    """
    chunks = range(req.vpp)
    rows = [
        [F(i, c) for c in chunks for i in range(req.microbatches)]
        + [BW(i, c) for c in reversed(chunks) for i in range(req.microbatches)]
        for _ in range(req.pp)
    ]
    return ScheduleTable.build(Placement.interleaved(req.pp, req.vpp), req.microbatches, rows, "gpipe")


@register("1f1b", vpp=1)
def one_f_one_b(req: ScheduleRequest) -> ScheduleTable:
    """1F1B (PipeDream-flush), Megatron's non-interleaved order: rank r warms up with min(pp-r-1, m) forwards.

    Its compute order at pp=4, m=6 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 BW3 BW4 BW5
        rank 1 | F0 F1 F2 BW0 F3 BW1 F4 BW2 F5 BW3 BW4 BW5
        rank 2 | F0 F1 BW0 F2 BW1 F3 BW2 F4 BW3 F5 BW4 BW5
        rank 3 | F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4 F5 BW5
    """
    require(req.vpp == 1, "1f1b", f"needs vpp = 1, got {req.vpp}; use interleaved-1f1b for vpp > 1")
    m = req.microbatches
    rows = [
        warmup_steady_cooldown([F(i) for i in range(m)], [BW(i) for i in range(m)], min(req.pp - r - 1, m))
        for r in range(req.pp)
    ]
    return ScheduleTable.build(Placement.interleaved(req.pp, 1), m, rows, "1f1b")


@register("interleaved-1f1b", default_vpp=2)
def interleaved_1f1b(req: ScheduleRequest, *, microbatch_group_size: int | None = None) -> ScheduleTable:
    """Megatron's interleaved 1F1B: chunks take turns in groups of `microbatch_group_size` microbatches (default: pp, or the least valid size).

    Matches megatron-core's order (``get_schedule_table`` and its warm-up count) for every shape Megatron
    accepts. Megatron requires the group size in [pp, m] and a last group of 0 or at least pp
    microbatches; a shorter last group makes ranks wait on each other (the validator proves the
    deadlock). So where pp does not divide m, the default is the least group size that leaves no short
    last group (pp=4, m=9: 5; pp=2, m=3: 3, one group), which is Megatron's order for that group size,
    and m < pp is a single group of m microbatches: every m >= 1 builds. A group size given explicitly
    is checked, not changed. With vpp = 1 it is 1F1B's order (Megatron's schedule without a virtual
    pipeline size), so the "any" vpp 'primuspipe list' shows holds.

    Its compute order at pp=4, m=4 (notation: :meth:`~primuspipe.ir.table.ScheduleTable.compact_grid`)::

        rank 0 | F0 F1 F2 F3 f0 f1 f2 f3 bw0 bw1 bw2 bw3 BW0 BW1 BW2 BW3
        rank 1 | F0 F1 F2 F3 f0 f1 f2 f3 bw0 bw1 bw2 bw3 BW0 BW1 BW2 BW3
        rank 2 | F0 F1 F2 F3 f0 f1 f2 bw0 f3 bw1 bw2 bw3 BW0 BW1 BW2 BW3
        rank 3 | F0 F1 F2 F3 f0 bw0 f1 bw1 f2 bw2 f3 bw3 BW0 BW1 BW2 BW3
    """
    p, v, m = req.pp, req.vpp, req.microbatches
    g = least_group_size(p, m) if microbatch_group_size is None else microbatch_group_size
    require(min(p, m) <= g <= m, "interleaved-1f1b",
            f"microbatch_group_size must be in [min(pp, microbatches)={min(p, m)}, microbatches={m}], got {g}")
    require(m % g == 0 or m % g >= p, "interleaved-1f1b",
            f"the last group would hold {m % g} < pp={p} microbatches (m={m}, group size {g}) and the ranks "
            f"would deadlock; use group size {least_group_size(p, m)} (the default), or a microbatch count that is "
            "a multiple of the group size or leaves at least pp over")
    groups = [range(start, min(start + g, m)) for start in range(0, m, g)]
    order = [(i, c) for grp in groups for c in range(v) for i in grp]
    forwards = [F(i, c) for i, c in order]
    backwards = [BW(i, v - 1 - c) for i, c in order]
    # One chunk per rank is Megatron's non-interleaved 1F1B (what it runs without a virtual size), so its warm-up.
    rows = [
        warmup_steady_cooldown(forwards, backwards, min(p - r - 1 if v == 1 else (p - r - 1) * 2 + (v - 1) * g, m * v))
        for r in range(p)
    ]
    return ScheduleTable.build(Placement.interleaved(p, v), m, rows, "interleaved-1f1b")


def least_group_size(pp: int, microbatches: int) -> int:
    """The least group size of at least ``min(pp, m)`` that leaves no short last group (0 or >= pp
    microbatches over); ``m`` itself always qualifies.

    >>> least_group_size(4, 8), least_group_size(4, 9), least_group_size(2, 3), least_group_size(4, 3)
    (4, 5, 3, 3)
    """
    return next(g for g in range(min(pp, microbatches), microbatches + 1)
                if microbatches % g == 0 or microbatches % g >= pp)
