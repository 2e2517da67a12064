"""What the node costs that opens a window of deferred Ws (``compute.probe_window``, per rank): where the
split probe measures it (``probe_windows``) and where the simulator charges it (``window_openings``: any
table), and the cost file."""

import math

import pytest
import yaml

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError
from primuspipe.ir.row_context import probe_windows, window_openings
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import B, BW, F, W
from primuspipe.passes.communication import add_communication
from primuspipe.passes.split_probe import split_backward_probe
from primuspipe.simulator import CostModel, simulate


def _by_hand(row):
    """Per node, read off the row directly: the row runs a BW, some earlier B's W runs at or after this
    node, the node is not a W, and no node before it in the same unbroken stretch of such pending Ws
    opened that stretch."""
    if not any(n.kind is NodeKind.BW for n in row):
        return [False] * len(row)
    pending = [any(b.kind is NodeKind.B and any(w.kind is NodeKind.W and (w.chunk, w.microbatch) == (b.chunk, b.microbatch)
                                                for w in row[i:]) for b in row[:i]) for i in range(len(row))]
    eligible = [p and n.kind.is_compute and n.kind is not NodeKind.W for p, n in zip(pending, row)]
    out = []
    for i in range(len(row)):
        start = i
        while start > 0 and pending[start - 1]:
            start -= 1
        out.append(eligible[i] and not any(eligible[start:i]))
    return out


def test_the_window_rule():
    assert probe_windows([F(0), F(1), B(0), F(2), B(1), W(0), W(1), BW(2)]) == [False, False, False, True, False,
                                                                                  False, False, False]
    assert not any(probe_windows([F(0), F(1), B(0), F(2), B(1), W(0), W(1)])), "every backward split: no window"
    assert not any(probe_windows([F(0), B(0), W(0), BW(1)])), "a W right after its B leaves nothing pending"
    other_chunk = [F(0, 1), B(0, 1), F(1), W(0, 1), BW(1)]
    assert probe_windows(other_chunk) == [False, False, True, False, False], "a W of any chunk pending"
    split = [F(0), F(1), B(0), F(2), B(1), W(0), W(1)]
    assert window_openings(split) == [False, False, False, True, False, False, False], "split rows hold Ws too"
    assert window_openings([F(0), B(0), W(0), F(1), B(1), W(1)]) == [False] * 6, "each W right after its B"
    zb_h2_like = [F(0), F(1), B(0), B(1), W(0), F(2), B(2), W(1), F(3), B(3), W(2), W(3), F(4), B(4), F(5)]
    assert window_openings(zb_h2_like) == [False] * 3 + [True] + [False] * 10 + [True], \
        "one opening however long the Ws stay pending; a new one once none is"


@pytest.mark.parametrize("pp, m, count", [(2, 4, 1), (2, 8, 2), (3, 9, 2), (4, 8, 2), (4, 12, 3)])
def test_the_probe_opens_windows_exactly_where_its_ws_wait(pp, m, count):
    probed = add_communication(split_backward_probe(build_schedule("1f1b", pp, m).compute_only(), count))
    for row in probed.ranks:
        compute = [n for n in row if n.kind.is_compute]
        assert [w for w, n in zip(probe_windows(row), row) if n.kind.is_compute] == _by_hand(compute)
        assert not any(w for w, n in zip(probe_windows(row), row) if not n.kind.is_compute)


@pytest.mark.parametrize("pp, m", [(2, 8), (3, 9), (4, 8)])
@pytest.mark.parametrize("share", [0.125, 0.5])
def test_the_simulator_charges_the_share_where_a_window_opens_only(pp, m, share):
    """In the probed 1F1B table, in ZB-H1 and ZB-H2 (a rank holding a W it deferred) alike; nothing in
    tables that never defer a W."""
    f, b, w = [1.0 + 0.25 * s for s in range(pp)], [1.5] * pp, [0.75] * pp
    cost = CostModel.per_stage(pp, f, b, w, bw=[2.0] * pp, time_unit="s")
    windowed = CostModel.per_stage(pp, f, b, w, bw=[2.0] * pp, time_unit="s", probe_window=share)
    probed = add_communication(split_backward_probe(build_schedule("1f1b", pp, m).compute_only(), 2))
    for table in (probed, build_schedule("zb-h1", pp, m), build_schedule("zb-h2", pp, m)):
        timeline = simulate(table, windowed).timeline()
        charged = 0
        for rt in timeline.ranks:
            inside = {n for n, x in zip(table.ranks[rt.rank], window_openings(table.ranks[rt.rank])) if x}
            previous = None
            for e in sorted(rt.events, key=lambda e: e.start):
                if e.node.kind.is_compute:
                    plain = cost.node_time(table.placement, rt.rank, e.node, previous)
                    expected = plain * (1 + share) if e.node in inside else plain
                    assert e.end - e.start == pytest.approx(expected), f"{table.algorithm} rank {rt.rank} {e.node}"
                    charged += e.node in inside
                    previous = e.node
        assert charged > 0
        assert simulate(table, windowed).step_time > simulate(table, cost).step_time
    for algorithm in ("1f1b", "gpipe"):  # no W deferred: no window
        table = build_schedule(algorithm, pp, m)
        assert simulate(table, windowed).step_time == simulate(table, cost).step_time


def test_each_rank_pays_its_own_share():
    """ZB-H1 at pp = 2: the first rank runs each W right after its B and pays nothing; the last rank
    defers its first Ws and pays its own share where that window opens."""
    table = build_schedule("zb-h1", 2, 6)
    cost = CostModel.per_stage(2, 1.0, 1.5, 0.75, time_unit="s")
    windowed = CostModel.per_stage(2, 1.0, 1.5, 0.75, time_unit="s", probe_window=(0.5, 0.125))
    plain, charged = simulate(table, cost).timeline(), simulate(table, windowed).timeline()
    for rank, share in ((0, 0.0), (1, 0.125)):
        spans = {e.node: e.end - e.start for e in plain.ranks[rank].events if e.node.kind.is_compute}
        for e, pending in zip((e for e in charged.ranks[rank].events if e.node.kind.is_compute),
                              window_openings([n for n in table.ranks[rank] if n.kind.is_compute])):
            expected = spans[e.node] * (1 + share if pending else 1)
            assert e.end - e.start == pytest.approx(expected), f"rank {rank} {e.node}"
    assert any(window_openings(table.ranks[1])) and not any(window_openings(table.ranks[0]))
    assert simulate(table, windowed).step_time > simulate(table, cost).step_time


def test_the_file_field_round_trips_and_an_old_file_has_none():
    data = {"time_unit": "s", "compute": {"f": 1.0, "b": 1.0, "w": 1.0, "bw": 1.5, "probe_window": 0.25}}
    model = CostModel.from_dict(data, pp=2, vpp=1)
    assert model.probe_window == 0.25 and model.for_shape(2, 2).probe_window == 0.25
    assert CostModel.from_dict(yaml.safe_load(yaml.safe_dump(model.to_dict())), pp=2, vpp=1) == model
    per_rank_data = {**data, "compute": {**data["compute"], "probe_window": [0.25, 0.0625]}}
    per_rank = CostModel.from_dict(per_rank_data, pp=2, vpp=1)
    assert per_rank.probe_window == (0.25, 0.0625) and per_rank.window_share(1) == 0.0625
    written = yaml.safe_load(yaml.safe_dump(per_rank.to_dict()))
    assert CostModel.from_dict(written, pp=2, vpp=2).probe_window == (0.25, 0.0625)
    old = CostModel.from_dict({"compute": {"f": 1.0, "b": 1.0, "w": 1.0}}, pp=2, vpp=1)
    assert old.probe_window == 0.0 and "probe_window" not in old.to_dict()["compute"]


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, "much", True, [0.1], [0.1, -0.2], [0.1, 2e3]])
def test_bad_values_are_refused_in_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match="compute.probe_window") as caught:
        CostModel.from_dict({"compute": {"f": 1, "b": 1, "w": 1, "probe_window": value}}, pp=2, vpp=1)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="compute.probe_window"):
        CostModel.per_stage(2, 1.0, 1.0, 1.0, probe_window=-1.0)
    with pytest.raises(ConfigError, match="compute.probe_window"):
        CostModel.per_stage(4, 1.0, 1.0, 1.0, probe_window=(0.1, 0.1, 0.1))

