import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from schedule_strategies import tables

from primuspipe.errors import ValidationError
from primuspipe.ir.node import BW, F, ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.table import ScheduleTable
from primuspipe.ir.activations import peak_in_flight
from primuspipe.passes.validation import check_pairing, validate


def _edit(table, rank, new_row):
    rows = list(table.ranks)
    rows[rank] = tuple(new_row)
    return table.with_ranks(rows)


def _refused(table, rank, row, check=validate) -> ValidationError:
    """The error ``check`` raises on ``table`` with ``rank``'s row replaced by ``row``."""
    with pytest.raises(ValidationError) as err:
        check(_edit(table, rank, row))
    return err.value


def _parse_rows(*rows):
    return [[ScheduleNode.parse(t) for t in row.split()] for row in rows]


def test_valid_tables_pass():
    for name, pp, m, vpp in [("1f1b", 4, 7, 1), ("interleaved-1f1b", 4, 8, 2), ("gpipe", 3, 2, 2)]:
        table = build_schedule(name, pp, m, vpp)
        assert validate(table) is table


def test_dropped_node_is_refused_naming_completeness():
    table = build_schedule("1f1b", 2, 3)
    row = [n for n in table.ranks[1] if str(n) != "BW1.0"]
    error = _refused(table, 1, row)
    assert error.rule == "completeness"
    assert "stage 1 (rank 1, chunk 0), microbatch 1 has 0 BW, 0 B and 0 W" in str(error)
    assert "fix:" in str(error)


def test_duplicated_node_is_refused_and_marked():
    table = build_schedule("1f1b", 2, 3).compute_only()
    row = list(table.ranks[0]) + [table.ranks[0][0]]
    error = _refused(table, 0, row)
    assert error.rule == "completeness" and "2 forwards" in str(error)
    assert set(error.nodes) == {(0, 0), (0, len(row) - 1)}  # only the two forwards are marked
    assert ">>F0.0<<" in str(error)


def test_consumer_before_producer_is_refused_naming_order():
    table = build_schedule("1f1b", 1, 2).compute_only()
    row = list(table.ranks[0])  # F0 BW0 F1 BW1
    row[0], row[1] = row[1], row[0]
    error = _refused(table, 0, row)
    assert error.rule == "order" and "BW0.0" in str(error) and "F(stage 0, mb 0)" in str(error)


def test_swapped_receives_are_refused_naming_pairing():
    table = build_schedule("1f1b", 4, 6)
    row = list(table.ranks[1])  # starts RECV_F0.0<0 RECV_F1.0<0 F0.0
    i, j = row.index(ScheduleNode.parse("RECV_F0.0<0")), row.index(ScheduleNode.parse("RECV_F1.0<0"))
    row[i], row[j] = row[j], row[i]
    error = _refused(table, 1, row)
    assert error.rule == "pairing"
    assert "rank 0's send #0 to rank 1 is SEND_F0.0>1" in str(error)
    assert "RECV_F1.0<0" in str(error)


def test_activation_and_gradient_between_same_two_ranks_cannot_be_confused():
    # pp=2, vpp=2: rank 0 sends both activations (stage 0->1) and gradients (stage 2->1) to rank 1.
    table = build_schedule("interleaved-1f1b", 2, 2, 2)
    row = list(table.ranks[1])
    recv_f = next(i for i, n in enumerate(row) if str(n).startswith("RECV_F") and n.chunk == 1)
    recv_b = next(i for i, n in enumerate(row) if str(n).startswith("RECV_B"))
    row[recv_f], row[recv_b] = row[recv_b], row[recv_f]
    error = _refused(table, 1, row, check_pairing)
    assert "activation" in str(error) and "gradient" in str(error) and "swapped" in str(error)


def test_cross_rank_compute_cycle_is_refused_naming_the_waiting_nodes():
    # rank 0 waits for mb 0's gradient before sending mb 1; rank 1 wants mb 1 before producing it.
    rows = [[F(0), BW(0), F(1), BW(1)], [F(0), F(1), BW(0), BW(1)]]
    compute = ScheduleTable.build(Placement.interleaved(2), 2, rows)
    with pytest.raises(ValidationError) as err:
        validate(compute)
    assert err.value.rule == "deadlock"
    assert "rank 0 node 1 (BW0.0) waits for the gradient of mb 0, stage 1 -> 0 from rank 1" in str(err.value)
    assert "rank 1 node 1 (F1.0) waits for the activation of mb 1, stage 0 -> 1 from rank 0" in str(err.value)


def test_send_delayed_behind_a_wait_is_a_deadlock():
    table = ScheduleTable.build(Placement.interleaved(2), 1, _parse_rows(
        "F0.0 RECV_B0.0<1 BW0.0 SEND_F0.0>1", "RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0"))
    with pytest.raises(ValidationError) as err:
        validate(table)
    # marked: where each rank stops (rank 0's BW0.0, rank 1's F0.0) and the receives they wait on
    assert err.value.rule == "deadlock" and set(err.value.nodes) == {(0, 2), (1, 1), (0, 1), (1, 0)}


def test_structure_errors_name_the_fix():
    table = ScheduleTable.build(Placement.interleaved(2), 1, _parse_rows(
        "F0.0 SEND_F0.0>0 RECV_B0.0<1 BW0.0", "RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0"))
    with pytest.raises(ValidationError, match="use peer 1") as err:
        validate(table)
    assert err.value.rule == "structure"
    bad_mb = ScheduleTable.build(Placement.interleaved(1), 1, _parse_rows("F0.0 BW0.0 F1.0"))
    with pytest.raises(ValidationError, match="microbatch 1"):
        validate(bad_mb)


def test_memory_bound():
    table = build_schedule("gpipe", 4, 8)
    assert peak_in_flight(table) == [8, 8, 8, 8]
    assert peak_in_flight(build_schedule("1f1b", 4, 8)) == [4, 3, 2, 1]
    with pytest.raises(ValidationError) as err:
        validate(table, max_in_flight=4)
    assert err.value.rule == "memory" and "F4.0" in str(err.value)
    validate(build_schedule("1f1b", 4, 8), max_in_flight=4)


MUTATIONS = ("drop", "duplicate", "producer_after_consumer", "swap_receives")


@given(tables(max_pp=5), st.sampled_from(MUTATIONS), st.randoms(use_true_random=False))
def test_random_mutations_are_refused_naming_a_rule(table, mutation, rnd):
    rank = rnd.randrange(table.pp)
    row = list(table.ranks[rank])
    if mutation == "drop":
        del row[rnd.randrange(len(row))]
    elif mutation == "duplicate":
        row.insert(rnd.randrange(len(row) + 1), row[rnd.randrange(len(row))])
    elif mutation == "producer_after_consumer":
        # move a forward after the backward of the same microbatch and chunk
        fwd = [i for i, n in enumerate(row) if n.kind.name == "F"]
        i = rnd.choice(fwd)
        mb, chunk = row[i].microbatch, row[i].chunk
        j = next(k for k, n in enumerate(row)
                 if any(kind.name in ("BW", "B") and (m, c) == (mb, chunk) for kind, m, c in n.parts()))
        row.insert(j, row.pop(i))
    else:
        recvs = {}
        for i, n in enumerate(row):
            if n.kind.is_recv:
                recvs.setdefault(n.peer, []).append(i)
        lanes = [idx for idx in recvs.values() if len(idx) >= 2]
        assume(lanes)  # the rank receives at least twice from one peer
        i, j = sorted(rnd.sample(rnd.choice(lanes), 2))
        row[i], row[j] = row[j], row[i]
    error = _refused(table, rank, row)
    assert error.rule in {"structure", "completeness", "order", "pairing", "deadlock"}
    assert error.nodes and "fix:" in str(error)
