"""1F1B and interleaved 1F1B against Megatron's own order."""

import types

import pytest

from primuspipe.errors import ScheduleShapeError
from primuspipe.ir.node import NodeKind
from primuspipe.algorithms.build import build_schedule


def _compute(table, rank):
    return [(n.kind.name, n.microbatch, n.chunk) for n in table.ranks[rank] if n.kind.is_compute]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_1f1b_warmup_and_megatron_order(pp, m):
    table = build_schedule("1f1b", pp, m)
    for r in range(pp):
        order = _compute(table, r)
        warmup = min(pp - r - 1, m)
        assert [k for k, _, _ in order[:warmup]] == ["F"] * warmup
        # Megatron: warm-up forwards, then (forward, backward) pairs, then the remaining backwards
        steady = m - warmup
        expect = [("F", i, 0) for i in range(warmup)]
        for k in range(steady):
            expect += [("F", warmup + k, 0), ("BW", k, 0)]
        expect += [("BW", i, 0) for i in range(steady, m)]
        assert order == expect


@pytest.fixture(scope="module")
def megatron_schedules():
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.pipeline_parallel import schedules

    return schedules


def _megatron_interleaved_order(schedules, pp, rank, vpp, m, group):
    """The compute order megatron-core's interleaved schedule runs on ``rank``, from its own tables.

    megatron-core's ``forward_backward_pipelining_with_interleaving`` runs ``num_warmup`` forwards,
    then for each remaining k the forward of virtual microbatch ``k + num_warmup`` followed by the
    backward of virtual microbatch ``k``, then the remaining backwards; virtual microbatch ``k`` is
    ``get_schedule_table(...)[k]`` and a backward visits chunks in reverse.
    """
    comm = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(size=lambda: pp, rank=lambda: rank), virtual_pipeline_model_parallel_size=vpp
    )
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(m, vpp, group, p2p_communicator=comm)
    table = schedules.get_schedule_table(m, vpp, group)
    fwd = [("F", mb, c) for mb, c in table]
    bwd = [("BW", mb, vpp - 1 - c) for mb, c in table]
    order = fwd[:warmup]
    for k in range(remaining):
        order += [fwd[k + warmup], bwd[k]]
    return order + bwd[remaining:]


# With the default group size (pp) Megatron needs m to be a multiple of pp; other m use a group size
SHAPES = [(2, 2, 2), (2, 2, 4), (2, 2, 6), (3, 2, 6), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16), (8, 4, 24)]


@pytest.mark.parametrize("pp, vpp, m", SHAPES)
def test_interleaved_equals_megatron_core(megatron_schedules, pp, vpp, m):
    table = build_schedule("interleaved-1f1b", pp, m, vpp)
    for rank in range(pp):
        assert _compute(table, rank) == _megatron_interleaved_order(megatron_schedules, pp, rank, vpp, m, pp)


@pytest.mark.parametrize("pp, vpp, m, group", [(2, 2, 5, 3), (2, 2, 3, 3), (4, 2, 10, 5), (4, 2, 6, 6), (4, 2, 9, 5), (3, 2, 7, 4)])
def test_interleaved_group_size_equals_megatron_core(megatron_schedules, pp, vpp, m, group):
    table = build_schedule("interleaved-1f1b", pp, m, vpp, microbatch_group_size=group)
    for rank in range(pp):
        assert _compute(table, rank) == _megatron_interleaved_order(megatron_schedules, pp, rank, vpp, m, group)


def test_interleaved_refuses_what_would_deadlock_and_accepts_m_below_pp():
    with pytest.raises(ScheduleShapeError, match="last group would hold 1 < pp=4"):
        build_schedule("interleaved-1f1b", 4, 5, 2, microbatch_group_size=4)  # given explicitly: checked, not changed
    one_chunk = build_schedule("interleaved-1f1b", 4, 8, 1)  # 'list' says any vpp: one chunk is 1F1B's order
    assert one_chunk.ranks == build_schedule("1f1b", 4, 8).ranks
    small = build_schedule("interleaved-1f1b", 4, 3, 2)  # Megatron refuses m < pp; one group of 3 validates
    assert sum(n.kind is NodeKind.F for n in small.ranks[0]) == 6


@pytest.mark.parametrize("pp, vpp, m, group", [(2, 2, 3, 3), (4, 2, 5, 5), (4, 2, 9, 5), (4, 2, 13, 7),
                                               (3, 3, 7, 4), (8, 2, 20, 10)])
def test_interleaved_builds_every_m_with_the_least_valid_group_size(megatron_schedules, pp, vpp, m, group):
    """Where the default group size (pp) would leave a short last group, the least valid one is taken:
    the table is Megatron's own order for that group size (validated by build_schedule)."""
    table = build_schedule("interleaved-1f1b", pp, m, vpp)
    for rank in range(pp):
        assert _compute(table, rank) == _megatron_interleaved_order(megatron_schedules, pp, rank, vpp, m, group)


def test_interleaved_builds_every_m_at_every_pp_and_vpp():
    for pp in range(1, 7):
        for vpp in (2, 3, 4):
            for m in range(1, 3 * pp + 2):
                build_schedule("interleaved-1f1b", pp, m, vpp)  # validated, never refused


def test_gpipe_runs_all_forwards_first():
    order = _compute(build_schedule("gpipe", 3, 4), 1)
    assert [k for k, _, _ in order] == ["F"] * 4 + ["BW"] * 4
