"""Memory-aware algorithms under a byte budget count what the simulator counts.

A split backward's B peaks above where it started (``b_rise_fraction``) and W keeps more than the retained share
(``w_excess_fraction``); the simulator's byte peak counts both. zb-auto under ``memory_limit_bytes`` must
return a table whose byte peak, as the simulator reports it, is within the budget on every rank, whenever
any table of its family fits (and be no slower than the fastest fixed table that fits); when none does it
says so in one line. Generated over pp 2-8, microbatch counts, uneven stage bytes, retained/excess/rise
fractions, and budgets from "nothing fits" to "everything fits".
"""

from __future__ import annotations

import random

import pytest

from primuspipe.algorithms import ScheduleRequest, list_algorithms
from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, ScheduleShapeError
from primuspipe.ir.activations import peak_in_flight
from primuspipe.ir.cost_model import CostModel, MemoryCost
from primuspipe.search.zb_auto import placements
from primuspipe.simulator import simulate

SEEDS = range(10)


def _case(seed: int) -> tuple[int, int, CostModel]:
    rng = random.Random(seed)
    pp = rng.randint(2, 8)
    m = rng.randint(pp, pp + 3)
    memory = MemoryCost.per_stage(
        pp, pp, activation_bytes=[rng.uniform(1.0, 3.0) * 1e9 for _ in range(pp)],
        w_retained_fraction=rng.choice([0.3, 0.8, 32 / 34, 1.0]), w_excess_fraction=rng.choice([0.0, 0.2, 0.8]),
        b_rise_fraction=rng.choice([0.0, 0.3, 0.84]), parameter_bytes=5e9)
    cost = CostModel.per_stage(pp, rng.uniform(0.8, 1.2), rng.uniform(1.5, 2.5), rng.uniform(0.5, 1.5), memory=memory)
    return pp, m, cost


def _family(pp: int, m: int, cost: CostModel) -> list[tuple[str, object]]:
    """The fixed algorithms' tables on every layout zb-auto searches (its family with ``include_fixed``)."""
    tables = []
    for layout in placements(ScheduleRequest(pp, None, m, cost), None):
        for info in list_algorithms():
            if info.placement == "any" or info.alias_of is not None or info.vpp not in (None, layout.vpp):
                continue
            try:
                table = build_schedule(info.name, pp, m, layout.vpp, cost=cost.for_shape(pp, layout.vpp),
                                       communication=False)
            except ScheduleShapeError:
                continue
            if table.placement == layout:
                tables.append((info.name, table))
    return tables


def _byte_peaks(table, cost: CostModel) -> list[float]:
    """The simulator's per-rank activation byte peak: what the verdict counts."""
    return [r.peak_activation_bytes for r in simulate(table, cost.for_shape(table.pp, table.vpp)).ranks]


def _fits(peaks: list[float], budget: tuple[float, ...]) -> bool:
    return all(p <= b * (1 + 1e-9) for p, b in zip(peaks, budget))


@pytest.mark.parametrize("seed", SEEDS)
def test_zb_auto_under_a_byte_budget_returns_a_table_that_fits_or_says_none_does(seed):
    pp, m, cost = _case(seed)
    family = [(name, table, _byte_peaks(table, cost), simulate(table, cost.for_shape(pp, table.vpp)).step_time)
              for name, table in _family(pp, m, cost)]
    tops = sorted(max(peaks) for _, _, peaks, _ in family)
    rng = random.Random(1000 + seed)
    # below the leanest fixed table (only a leaner construction can fit), just above it (only the leanest fits),
    # anywhere up to above the fattest; each rank's budget a little different
    spread = 1.15
    level = (0.85 * tops[0] / spread, rng.uniform(tops[0], tops[1]), rng.uniform(tops[0], 1.1 * tops[-1]))[seed % 3]
    budget = tuple(level * rng.uniform(1.0, spread) for _ in range(pp))
    fitting = [(step, name) for name, _, peaks, step in family if _fits(peaks, budget)]
    try:
        table = build_schedule("zb-auto", pp, m, cost=cost, memory_limit_bytes=budget, fills=8, milp_nodes=20)
    except ScheduleShapeError as refusal:
        assert not fitting, f"zb-auto refused though {fitting} fit"
        assert "\n" not in str(refusal) and "raise the memory limit" in str(refusal)
        return
    assert _fits(_byte_peaks(table, cost), budget), (budget, _byte_peaks(table, cost))
    step = simulate(table, cost.for_shape(pp, table.vpp)).step_time
    if fitting:
        assert step <= min(fitting)[0] + 1e-9, (step, min(fitting))


@pytest.mark.parametrize("seed", SEEDS[::3])
def test_the_unit_caps_bracket_the_byte_count(seed):
    # within the sure cap every table fits the bytes; every table that fits holds at most the loose cap
    pp, m, cost = _case(seed)
    rng = random.Random(2000 + seed)
    for _, table in _family(pp, m, cost):
        memory = cost.for_shape(pp, table.vpp).memory
        peaks = _byte_peaks(table, cost)
        assert memory.peak_bytes(table) == pytest.approx(peaks, rel=1e-12)  # one counter, simulator and budget
        budget = [p * rng.uniform(0.7, 1.3) for p in peaks]
        sure, loose = memory.chunk_caps(table.placement, budget)
        units = max(peak_in_flight(table, memory.w_retained_fraction)) * table.vpp
        if units <= sure:
            assert _fits(peaks, tuple(budget))
        if _fits(peaks, tuple(budget)):
            assert units <= loose + 1e-9


def test_a_byte_budget_needs_bytes_and_a_finite_number_per_rank():
    with pytest.raises(ConfigError, match="activation bytes"):
        ScheduleRequest(2, 1, 4, CostModel.per_stage(2, 1, 1, 1), memory_limit_bytes=1e9)
    _, _, cost = _case(0)
    with pytest.raises(ConfigError, match="one number per rank"):
        ScheduleRequest(cost.num_stages, 1, 4, cost, memory_limit_bytes=(1e9,) * (cost.num_stages + 1))
    with pytest.raises(ConfigError, match=r"memory_limit_bytes\[0\] must be a finite number"):
        ScheduleRequest(cost.num_stages, 1, 4, cost, memory_limit_bytes=float("nan"))
    with pytest.raises(ConfigError, match=r"memory_limit_bytes\[1\] must be >= 0"):
        ScheduleRequest(cost.num_stages, 1, 4, cost, memory_limit_bytes=(1e9, -1.0) + (1e9,) * (cost.num_stages - 2))


@pytest.mark.parametrize("seed", range(3))
def test_zb_auto_refuses_in_one_line_when_no_table_fits(seed):
    # less than one microbatch's activations on every rank: not even one forward fits
    pp, m, cost = _case(seed)
    budget = 0.5 * min(cost.memory.activation_bytes) / 2  # a chunk holds at least half a 1F1B stage's bytes
    with pytest.raises(ScheduleShapeError, match="raise the memory limit") as refusal:
        build_schedule("zb-auto", pp, m, cost=cost, memory_limit_bytes=budget, fills=8, milp_nodes=20)
    assert "\n" not in str(refusal.value) and "GB of activations" in str(refusal.value)
