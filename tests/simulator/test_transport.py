"""The simulator times sends and receives on the streams of the chosen transport semantics."""

import functools
from pathlib import Path

import pytest
from shipped_tables import shipped_tables
from simulator_support import simulate_rows, text_table

from primuspipe.algorithms.build import build_schedule
from primuspipe.cli import main
from primuspipe.errors import SimulationError
from primuspipe.ir.cost_model import HostCost
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.streams import SEMANTICS, _Replay, replay, semantics_named
from primuspipe.simulator import CostModel, Link, P2PCost, simulate

LEGACY = Path(__file__).parents[1] / "fixtures" / "legacy_1f1b_pp2_m4.json"


def _latency(pp: int, latency: float, **rest) -> CostModel:
    return CostModel.per_stage(pp, 1, 1, 1, p2p=P2PCost(intra_node=Link(latency), inter_node=Link(latency)), **rest)


# rank 0 posts each microbatch's gradient receive before its next activation send: under nccl-pair
# both directions share the pair's stream, so SEND_F1.0 (posted at 2) runs only once RECV_B0.0 has
# completed (5.0), while rank 1 posted RECV_F1.0 at 4.5 -- the transfer starts at 5.0, not 4.5
QUEUED = ["F0.0 SEND_F0.0>1 RECV_B0.0<1 F1.0 SEND_F1.0>1 RECV_B1.0<1 BW0.0 BW1.0",
          "RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 BW1.0 SEND_B1.0>0"]


@pytest.mark.parametrize("semantics, send_f1_end, step", [
    ("gloo", 5.0, 10.5), ("primuspipe", 5.0, 10.5), ("nccl-pair", 5.5, 11.0), ("nccl-group", 5.5, 11.0)])
def test_a_transfer_queued_behind_the_other_direction_starts_late(semantics, send_f1_end, step):
    """F = B = W = 1 (BW = 2), every transfer 0.5. Rank 1's SEND_B0.0 is posted at 4.5 (after F0.0 at
    1.5-2.5 and BW0.0 to 4.5), so the gradient arrives at 5.0 under every semantics; F1.0's activation
    arrives at 5.0 on per-direction streams and at 5.5 on a shared pair stream, and the delay carries
    to the step's end."""
    result = simulate(text_table(2, QUEUED, m=2), _latency(2, 0.5), semantics)
    rank0, rank1 = result.ranks
    assert (rank0.starts[4], rank0.ends[4]) == (2.0, send_f1_end)      # SEND_F1.0: posted, arrived
    assert (rank1.starts[4], rank1.ends[4]) == (4.5, send_f1_end)      # RECV_F1.0
    assert rank0.ends[2] == rank1.ends[3] == 5.0                       # the gradient of mb 0
    assert (rank1.starts[5], rank1.ends[5]) == (send_f1_end, send_f1_end + 1)  # F1.0
    assert result.step_time == step


@pytest.mark.parametrize("semantics, arrivals", [("gloo", (2.5, 3.5)), ("primuspipe", (2.5, 4.0))])
def test_a_stream_carries_one_transfer_at_a_time(semantics, arrivals):
    """Rank 1 posts both receives at 0, rank 0 sends at 1 and 2, each transfer takes 1.5: on gloo they
    overlap; on primuspipe's stream for 0 -> 1 the second starts when the first arrives (2.5)."""
    rows = ["F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 BW0.0 RECV_B1.0<1 BW1.0",
            "RECV_F0.0<0 RECV_F1.0<0 F0.0 BW0.0 SEND_B0.0>0 F1.0 BW1.0 SEND_B1.0>0"]
    result = simulate(text_table(2, rows, m=2), _latency(2, 1.5), semantics)
    assert (result.ranks[0].ends[1], result.ranks[0].ends[3]) == arrivals
    assert (result.ranks[1].ends[0], result.ranks[1].ends[1]) == arrivals


def test_the_ops_of_a_batch_progress_together():
    """pp=3, every transfer 1: rank 1 posts SEND_F1.0>2 and RECV_B0.0<2 back to back, rank 2 posts
    SEND_B0.0>1 and RECV_F1.0<1 back to back. On nccl-group's one stream each rank's first waits for a
    peer whose matching operation is queued behind its own first: refused. As batches (nccl-batched)
    each pair runs together from 5 (rank 1) and 7 (rank 2): both transfers arrive at 8."""
    rows = ["F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 BW0.0 RECV_B1.0<1 BW1.0",
            "RECV_F0.0<0 F0.0 SEND_F0.0>2 RECV_F1.0<0 F1.0 SEND_F1.0>2 RECV_B0.0<2 BW0.0 SEND_B0.0>0 RECV_B1.0<2 BW1.0 "
            "SEND_B1.0>0",
            "RECV_F0.0<1 F0.0 BW0.0 SEND_B0.0>1 RECV_F1.0<1 F1.0 BW1.0 SEND_B1.0>1"]
    table = text_table(3, rows, m=2)
    with pytest.raises(SimulationError, match="nccl-group .*queued on rank 1's group stream"):
        simulate(table, _latency(3, 1.0), "nccl-group")
    rank1 = simulate(table, _latency(3, 1.0), "nccl-batched").ranks[1]
    assert [(rank1.starts[i], rank1.ends[i]) for i in (5, 6)] == [(5.0, 8.0), (5.0, 8.0)]
    assert (rank1.starts[7], rank1.ends[7]) == (8.0, 10.0)  # BW0.0 once the gradient is in


def test_a_batched_receive_is_there_for_its_consumer_when_its_batch_completes():
    """F = B = W = 1 (BW = 2), every transfer 0.5. Rank 0 posts F1.0's activation and both gradients as
    one batch (nodes 3-5): the gradient of mb 0 arrives at 5.0, that of mb 1 at 8.5, and NCCL's one
    request for the batch makes BW0.0 wait for both (the compute stream waits for the group's end)."""
    rows = ["F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 RECV_B1.0<1 BW0.0 BW1.0",
            "RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 BW1.0 SEND_B1.0>0"]
    result = simulate(text_table(2, rows, m=2), _latency(2, 0.5), "nccl-batched")
    rank0 = result.ranks[0]
    assert (rank0.ends[4], rank0.ends[5]) == (5.0, 8.5)  # each transfer's own arrival
    assert (rank0.starts[6], rank0.starts[7]) == (8.5, 10.5)
    assert result.step_time == 12.5


def test_the_legacy_posting_is_refused_under_nccl_pair_with_the_cycle_and_the_command():
    table = ScheduleTable.from_json(LEGACY.read_text())
    assert replay(table, "gloo") is None and replay(table, "nccl-pair") is not None
    simulate(table, _latency(2, 0.1), "gloo")
    with pytest.raises(SimulationError, match=r"cannot complete under the nccl-pair transport semantics; .*"
                       r"queued on rank \d's pair stream 0<->1 behind .*primuspipe validate FILE --semantics nccl-pair"):
        simulate(table, _latency(2, 0.1), "nccl-pair")


SHAPES = [(2, 2), (2, 5), (3, 6), (4, 4), (4, 9)]


@functools.cache
def _shipped_tables() -> list[ScheduleTable]:
    return shipped_tables(SHAPES)


@pytest.mark.parametrize("semantics", list(SEMANTICS))
def test_simulate_refuses_exactly_the_tables_the_replay_refuses(semantics):
    """Every shipped algorithm at small shapes: the timed streams complete iff the validator's replay
    of the same semantics does, so a prediction never describes a run that would hang (nor refuses
    one that would not)."""
    tables, completed = _shipped_tables(), 0
    for table in tables:
        cost = _latency(table.pp, 0.3).for_shape(table.pp, table.vpp)
        if replay(table, semantics) is not None:
            with pytest.raises(SimulationError, match=f"--semantics {semantics}"):
                simulate(table, cost, semantics)
        else:
            completed += 1
            assert simulate(table, cost, semantics).step_time > 0
    assert len(tables) >= 30
    assert completed == len(tables) if semantics in ("gloo", "primuspipe") else completed < len(tables)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe-v"])
def test_no_compute_waits_for_the_send_it_proves_delivered(name):
    """The runner completes, at a compute node, the earlier send its input proves delivered; the
    simulator leaves that wait out because it never delays: check it on shipped tables with slow links."""
    pp, m = 4, 9
    table = build_schedule(name, pp, m)
    result = simulate(table, _latency(pp, 0.7).for_shape(pp, table.vpp))
    replayed, waits = _Replay(table, semantics_named("primuspipe")), 0
    for rank, (program, nodes, row) in enumerate(zip(replayed.programs, replayed.nodes, result.ranks)):
        for entry, i in zip(program, nodes):
            if entry < 0 and i < len(row.nodes):  # node i waits for op ~entry
                assert row.ends[replayed.index[~entry]] <= row.starts[i], (rank, i)
                waits += 1
    assert waits >= table.microbatches


@pytest.mark.parametrize("semantics", ["nccl-pair", "primuspipe", "nccl-batched"])
def test_shared_cores_with_a_core_per_rank_time_the_streams_as_dedicated_ranks(semantics):
    table = text_table(2, QUEUED, m=2)
    dedicated = simulate(table, _latency(2, 0.4), semantics)
    shared = simulate(table, _latency(2, 0.4, host=HostCost(cores=2.0)), semantics)
    assert shared.step_time == pytest.approx(dedicated.step_time)
    for a, b in zip(dedicated.ranks, shared.ranks):
        assert a.ends == pytest.approx(b.ends)


def test_cli_semantics_flag(capsys):
    argv = ("simulate", "--algorithm", "1f1b", "--pp", "2", "-m", "4", "--p2p", "0.5")
    assert main([*argv, "--semantics", "nccl-pair"]) != 0  # nothing could be simulated: the reason, one line
    err = capsys.readouterr().err.replace("\n", " ")
    assert "cannot complete under the nccl-pair transport semantics" in err
    assert "primuspipe validate FILE --semantics nccl-pair" in " ".join(err.split())
    [gloo] = simulate_rows(capsys, *argv[1:], "--semantics", "gloo")
    [default] = simulate_rows(capsys, *argv[1:])
    assert default["step_time"] == gloo["step_time"] == 17.0  # 1f1b's streams never queue a transfer
