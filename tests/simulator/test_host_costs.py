"""What a step spends outside its kernels: host time per node and per posting, cold first nodes, and
ranks sharing cores -- hand-computed event logs, and the YAML form of the new terms."""

import math
from dataclasses import replace

import pytest

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, SimulationError
from primuspipe.ir.cost_model import HostCost
from primuspipe.ir.costs import ComputeCosts
from primuspipe.simulator import CostModel, Link, P2PCost, simulate

HOST = HostCost(overhead=(("f", 0.125), ("bw", 0.25)), send=0.0625, recv=0.03125)


def test_host_time_before_nodes_and_postings():
    """1F1B pp=2, m=1, F=1, BW=2, latency 0.5. A posting takes its host time and is stamped when
    made; a compute node starts its kind's host time after the rank is free and its input is in.

    rank 0: RECV_B posted at 0.03125; F at 0.15625-1.15625; SEND_F posted at 1.21875.
    rank 1: RECV_F posted at 0.03125; the activation arrives at 1.71875, F runs 1.84375-2.84375, BW
    3.09375-5.09375, SEND_B posted at 5.15625, the gradient arrives at 5.65625; rank 0's BW runs
    5.90625-7.90625.
    """
    cost = CostModel.per_stage(2, 1, 1, 1, p2p=P2PCost(intra_node=Link(0.5)), host=HOST)
    result = simulate(build_schedule("1f1b", pp=2, microbatches=1), cost)
    assert result.event_log() == [
        (0.03125, 5.65625, 0, "RECV_B0.0<1"),
        (0.03125, 1.71875, 1, "RECV_F0.0<0"),
        (0.15625, 1.15625, 0, "F0.0"),
        (1.21875, 1.71875, 0, "SEND_F0.0>1"),
        (1.84375, 2.84375, 1, "F0.0"),
        (3.09375, 5.09375, 1, "BW0.0"),
        (5.15625, 5.65625, 1, "SEND_B0.0>0"),
        (5.90625, 7.90625, 0, "BW0.0"),
    ]
    assert result.step_time == 7.90625
    assert [r.busy_time for r in result.ranks] == [3.0, 3.0], "host time is not compute"


def test_each_chunks_first_node_of_a_kind_pays_its_cold_start():
    """pp=1, m=3, F=1 and BW=1: the first F takes 0.5 more, the first BW 0.25 + 0.25 more."""
    cost = CostModel.per_stage(1, 1, 0.5, 0.5, cold_start=ComputeCosts.per_stage(1, 0.5, 0.25, 0.25))
    result = simulate(build_schedule("1f1b", pp=1, microbatches=3), cost)
    durations = [e - s for s, e in zip(result.ranks[0].starts, result.ranks[0].ends)]
    assert [str(n) for n in result.ranks[0].nodes] == ["F0.0", "BW0.0", "F1.0", "BW1.0", "F2.0", "BW2.0"]
    assert durations == [1.5, 1.5, 1.0, 1.0, 1.0, 1.0] and result.step_time == 7.0


@pytest.mark.parametrize("cores, step", [(1.0, 6.0), (2.0, 5.0)])
def test_ranks_sharing_cores_slow_each_other_while_both_are_busy(cores, step):
    """ZB-H1 pp=2, m=1, F=B=W=1, free transfers. From t=3 rank 0's B and rank 1's W run at once: on
    one core each gets half of it, so both end at 5 (and rank 0's W at 6); on two cores nothing is
    shared and the step is the dedicated one. A node is reported as lasting its own work, ending when
    it ends (the OS gives a rank its core for a node; the sharing is waiting before it)."""
    cost = CostModel.per_stage(2, 1, 1, 1, host=HostCost(cores=cores))
    result = simulate(build_schedule("zb-h1", pp=2, microbatches=1), cost)
    assert result.step_time == step
    dedicated = simulate(build_schedule("zb-h1", pp=2, microbatches=1), replace(cost, host=HostCost()))
    assert (result.step_time == dedicated.step_time) == (cores >= 2)
    rank1 = dict(zip(map(str, result.ranks[1].nodes), result.ranks[1].cpu))
    assert rank1["W0.0"] == (2.0, 3.0), "a node's CPU stamps count the work its rank has done"
    w = dict(zip(map(str, result.ranks[1].nodes), zip(result.ranks[1].starts, result.ranks[1].ends)))["W0.0"]
    assert w == ((4.0, 5.0) if cores == 1 else (3.0, 4.0))
    assert [r.busy_time for r in result.ranks] == [3.0, 3.0]


def test_enough_cores_time_exactly_as_a_device_per_rank():
    """The processor-sharing loop with as many cores as ranks gives the dedicated loop's every time."""
    cost = CostModel.per_stage(8, [1.0, 1.5] * 4, 0.75, 0.5, p2p=P2PCost(intra_node=Link(0.1)), host=HOST,
                               cold_start=ComputeCosts.per_stage(8, 0.25, 0.125, 0.0))
    table = build_schedule("zbv", pp=4, microbatches=8)
    dedicated, shared = simulate(table, cost), simulate(table, replace(cost, host=replace(HOST, cores=4)))
    for a, b in zip(dedicated.ranks, shared.ranks):
        assert all(math.isclose(x, y, abs_tol=1e-9) for x, y in zip(a.starts + a.ends, b.starts + b.ends))


def test_background_cpu_takes_its_share_of_the_cores():
    """Each rank's background CPU is taken from its node's cores for the whole step: 2 cores less
    2 x 0.25 time exactly as 1.5 cores, and the dump of it says what a run's would (process CPU =
    main thread's + background x the rank's span)."""
    table = build_schedule("1f1b", pp=2, microbatches=4)
    base = CostModel.per_stage(2, 1, 1, 1, p2p=P2PCost(ranks_per_node=2), host=HostCost(cores=2.0))
    quiet = simulate(table, base)
    busy = simulate(table, replace(base, host=HostCost(cores=2.0, background=0.25)))
    assert quiet.step_time == simulate(table, replace(base, host=HostCost())).step_time, "a core each: as dedicated"
    assert busy.step_time > quiet.step_time
    same = simulate(table, replace(base, host=HostCost(cores=1.5)))
    for a, b in zip(busy.ranks, same.ranks):
        assert a.starts == b.starts and a.ends == b.ends
    timeline = busy.timeline()
    for facts, rank in zip(timeline.meta["ranks"], timeline.ranks):
        assert facts["process_cpu"] - facts["thread_cpu"] == pytest.approx(0.25 * rank.span)
    free = simulate(table, replace(base, host=HostCost(background=0.25)))
    assert free.step_time == simulate(table, replace(base, host=HostCost())).step_time, "no cores: no effect"


def _messages(rank) -> int:
    return sum(1 for e in rank.events if e.node.kind.is_send or e.node.kind.is_recv)


@pytest.mark.parametrize("algorithm, pp, vpp", [("1f1b", 2, 1), ("1f1b", 3, 1), ("interleaved-1f1b", 3, 2),
                                                 ("zbv", 3, 2), ("v-half", 4, 2)])
def test_message_cpu_takes_the_cores_its_messages_need_over_the_step(algorithm, pp, vpp):
    """Each message a rank sends or receives costs ``host.message_cpu`` of CPU off its main thread, spread
    over the step: the step is the one of a host whose cores lack exactly that share (the CPU of all its
    ranks' messages over the step), and the dump's process CPU carries it beside the main thread's."""
    table = build_schedule(algorithm, pp=pp, microbatches=2 * pp)
    base = CostModel.per_stage(pp * vpp, 1, 1, 1, p2p=P2PCost(ranks_per_node=pp),
                               host=HostCost(cores=pp - 0.5, background=0.02))
    charged = simulate(table, replace(base, host=replace(base.host, message_cpu=0.05)))
    assert charged.step_time > simulate(table, base).step_time
    timeline = charged.timeline()
    messages = sum(map(_messages, timeline.ranks))
    same = simulate(table, replace(base, host=replace(base.host, cores=pp - 0.5 - 0.05 * messages / charged.step_time)))
    assert same.step_time == pytest.approx(charged.step_time, rel=1e-5)  # settled to 1e-6 a round
    for facts, rank in zip(timeline.meta["ranks"], timeline.ranks):
        assert facts["process_cpu"] - facts["thread_cpu"] == pytest.approx(0.02 * rank.span + 0.05 * _messages(rank))
    free = replace(base, host=HostCost(message_cpu=0.05))
    assert simulate(table, free).step_time == simulate(table, replace(base, host=HostCost())).step_time, "no cores"


def test_message_cpu_weighs_on_the_schedule_that_sends_more():
    """Same work, same host: interleaved-1f1b sends twice 1F1B's messages per microbatch and rank, so the
    same per-message CPU lengthens its step by a larger share (a rate alone charges both alike)."""
    def slowdown(algorithm: str, vpp: int) -> float:
        table = build_schedule(algorithm, pp=3, microbatches=6)
        base = CostModel.per_stage(3 * vpp, 2 / vpp, 2 / vpp, 1 / vpp, p2p=P2PCost(ranks_per_node=3),
                                   host=HostCost(cores=2.0))
        return simulate(table, replace(base, host=HostCost(cores=2.0, message_cpu=0.05))).step_time / \
            simulate(table, base).step_time
    assert slowdown("interleaved-1f1b", 2) > slowdown("1f1b", 1) > 1


def test_contention_costs_nothing_while_every_busy_rank_has_a_core():
    cost = CostModel.per_stage(4, [1.0, 1.5] * 2, 0.75, 0.5, p2p=P2PCost(ranks_per_node=4), host=HostCost(cores=4.0))
    table = build_schedule("zb-h1", pp=4, microbatches=8)
    calm, crowded = simulate(table, cost), simulate(table, replace(cost, host=HostCost(cores=4.0, contention=0.3)))
    for a, b in zip(calm.ranks, crowded.ranks):
        assert all(math.isclose(x, y, abs_tol=1e-9) for x, y in zip(a.starts + a.ends, b.starts + b.ends))


def test_contention_slows_work_on_crowded_cores_and_the_dump_shows_its_cpu():
    """Four ranks on one core: a node's work takes more CPU while others are busy; the dump draws each
    compute node lasting the CPU it took (as a run's dump of a time-sliced rank does), never less than
    its work, and the ranks' CPU in all is their work's plus the contention's."""
    cost = CostModel.per_stage(4, 1.0, 1.0, 1.0, p2p=P2PCost(ranks_per_node=4), host=HostCost(cores=1.0))
    table = build_schedule("1f1b", pp=4, microbatches=8)
    calm, crowded = simulate(table, cost), simulate(table, replace(cost, host=HostCost(cores=1.0, contention=0.2)))
    assert crowded.step_time > calm.step_time
    extra = work = 0.0
    for rank in crowded.ranks:
        for node, start, end, (cpu_start, cpu_end) in zip(rank.nodes, rank.starts, rank.ends, rank.cpu):
            if node.kind.is_compute:
                own = cost.node_time(table.placement, 0, node)
                assert end - start == pytest.approx(cpu_end - cpu_start) and end - start >= own - 1e-12
                extra, work = extra + (end - start) - own, work + own
    assert 0 < extra <= 0.2 * 3 * work, "at most 3 ranks beyond the core, each costing 0.2 of the work"


@pytest.mark.parametrize("speed", [0.5, 0.9])
@pytest.mark.parametrize("algorithm, pp, m", [("1f1b", 2, 2), ("1f1b", 3, 6), ("zb-h1", 4, 8), ("zbv", 2, 4),
                                              ("interleaved-1f1b", 3, 6), ("v-half", 4, 8)])
def test_a_rank_with_a_core_to_itself_runs_at_host_speed(algorithm, pp, m, speed):
    """``host.speed``: with a core per rank nothing is shared, yet every job (host time and work) runs at
    ``speed`` of a core, alone or beside others: with free transfers every time is the dedicated run's of
    the same step at work / speed, and each node's CPU is still its work."""
    table = build_schedule(algorithm, pp, m)
    n = table.placement.num_stages
    f = [1.0 + 0.5 * (s % 2) for s in range(n)]
    cost = CostModel.per_stage(n, f, 0.75, 0.5, p2p=P2PCost(ranks_per_node=pp), host=HOST,
                               cold_start=ComputeCosts.per_stage(n, 0.25, 0.125, 0.0))
    slow = simulate(table, replace(cost, host=replace(HOST, cores=float(pp), speed=speed)))
    scaled = replace(cost, compute=ComputeCosts.per_stage(n, [x / speed for x in f], 0.75 / speed, 0.5 / speed),
                     host=HostCost(overhead=tuple((k, v / speed) for k, v in HOST.overhead), send=HOST.send / speed,
                                   recv=HOST.recv / speed),
                     cold_start=ComputeCosts.per_stage(n, 0.25 / speed, 0.125 / speed, 0.0))
    assert slow.step_time == pytest.approx(simulate(table, scaled).step_time, rel=1e-9)
    full = simulate(table, replace(cost, host=replace(HOST, cores=float(pp))))
    assert slow.step_time == pytest.approx(full.step_time / speed, rel=1e-9)
    for rank in slow.ranks:
        for node, (cpu_start, cpu_end) in zip(rank.nodes, rank.cpu):
            if node.kind.is_compute:
                assert cpu_end - cpu_start >= cost.node_time(table.placement, rank.rank, node) - 1e-12


def test_speed_and_sharing_slow_a_rank_by_the_smaller_share():
    """ZB-H1 pp=2, m=1, F=B=W=1 on 1.5 cores at speed 0.9: alone a rank runs at 0.9, beside the other at
    0.75 (1.5 / 2): rank 0's F and rank 1's F and B run alone (1 / 0.9 each), rank 0's B beside rank 1's
    W (1 / 0.75), rank 0's W alone again."""
    cost = CostModel.per_stage(2, 1, 1, 1, host=HostCost(cores=1.5, speed=0.9))
    result = simulate(build_schedule("zb-h1", pp=2, microbatches=1), cost)
    assert result.step_time == pytest.approx(4 / 0.9 + 1 / 0.75)
    ends = {str(n): e for n, e in zip(result.ranks[1].nodes, result.ranks[1].ends)}
    assert ends["B0.0"] == pytest.approx(3 / 0.9) and ends["W0.0"] == pytest.approx(3 / 0.9 + 1 / 0.75)
    unslowed = simulate(build_schedule("zb-h1", pp=2, microbatches=1), replace(cost, host=HostCost(cores=1.5)))
    assert unslowed.step_time == pytest.approx(4 + 1 / 0.75)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "nan", True])
def test_a_host_speed_that_is_not_a_share_of_a_core_is_refused(bad):
    data = {"time_unit": "s", "compute": {"f": 1, "b": 1, "w": 1}, "host": {"cores": 2, "speed": bad}}
    with pytest.raises(ConfigError, match=r"host.speed"):
        CostModel.from_dict(data, pp=2, vpp=1)


def test_background_that_leaves_no_core_is_refused():
    table = build_schedule("1f1b", pp=2, microbatches=4)
    cost = CostModel.per_stage(2, 1, 1, 1, p2p=P2PCost(ranks_per_node=2), host=HostCost(cores=1.0, background=0.5))
    with pytest.raises(SimulationError, match=r"host.background .* leaves no core free .* lower host.background"):
        simulate(table, cost)


def test_message_cpu_that_leaves_no_core_is_refused():
    """2 time units of CPU per message on one core: the messages of a short step would need more than the
    core; the simulator names both host terms and the fix instead of running a step with no core."""
    cost = CostModel.per_stage(2, 1, 1, 1, p2p=P2PCost(ranks_per_node=2), host=HostCost(cores=1.0, message_cpu=2.0))
    with pytest.raises(SimulationError, match=r"host.message_cpu \(2 per message\) leaves no core free .* lower "
                                              r"host.background or host.message_cpu or raise host.cores"):
        simulate(build_schedule("1f1b", pp=2, microbatches=4), cost)


def test_host_and_cold_start_in_yaml_round_trip():
    data = {"time_unit": "s", "compute": {"f": [1, 2], "b": 1, "w": 1, "cold_start": {"f": 0.5}},
            "host": {"overhead": {"f": 0.1, "bw": 0.2}, "send": 0.05, "recv": 0.025, "cores": 2, "background": 0.01,
                     "message_cpu": 0.002}}
    model = CostModel.from_dict(data, pp=2, vpp=2)
    assert model.host == HostCost((("bw", 0.2), ("f", 0.1)), 0.05, 0.025, 2.0, 0.01, message_cpu=0.002)
    assert model.cold_start.forward == (0.25, 0.25, 0.25, 0.25), "per 1F1B stage, split among its chunks"
    assert CostModel.from_dict(model.to_dict(), pp=2, vpp=2) == model
    assert "host" not in CostModel.per_stage(2, 1, 1, 1).to_dict(), "a free host is not written"


@pytest.mark.parametrize("host, match", [
    ({"send": -1}, r"host.send \(a time >= 0\) must be >= 0"),
    ({"send": True}, r"host.send \(a time >= 0\) must be a number"),
    ({"background": "fast"}, r"host.background \(a share of a core >= 0\)"),
    ({"message_cpu": -0.001}, r"host.message_cpu \(a time >= 0\) must be >= 0"),
    ({"message_cpu": float("inf")}, r"host.message_cpu \(a time >= 0\) must be a finite number"),
    ({"message_cpu": "fast"}, r"host.message_cpu \(a time >= 0\)"),
    ({"message_cpu": True}, r"host.message_cpu \(a time >= 0\) must be a number"),
    ({"contention": -0.1}, r"host.contention \(a share >= 0\) must be >= 0"),
    ({"overhead": {"f": float("nan")}}, r"host.overhead.f \(a time >= 0\) must be a finite number"),
    ({"cores": 0}, r"host.cores \(a number of cores > 0\) must be > 0"),
    ({"overhead": {"x": 1}}, r"host.overhead has unknown key\(s\) \['x'\]"),
    ({"latency": 1}, r"host has unknown key\(s\) \['latency'\]"),
])
def test_bad_host_values_are_refused_naming_the_field(host, match):
    with pytest.raises(ConfigError, match=match):
        CostModel.from_dict({"compute": {"f": 1, "b": 1, "w": 1}, "host": host}, pp=2, vpp=1)


@pytest.mark.parametrize("key, value", [("background", 0.05), ("contention", 0.1), ("speed", 0.9),
                                        ("message_cpu", 0.002)])
def test_shared_core_terms_without_cores_are_refused_not_ignored(key, value):
    # every term of the shared-cores simulator means nothing without host.cores: given alone it would be
    # dropped silently; at its neutral value (what to_dict writes for a model without cores) it is accepted
    base = {"compute": {"f": 1, "b": 1, "w": 1}}
    with pytest.raises(ConfigError, match=rf"host.{key} is given without host.cores.*give host.cores"):
        CostModel.from_dict({**base, "host": {key: value}}, pp=2, vpp=1)
    shared = CostModel.from_dict({**base, "host": {"cores": 2, key: value}}, pp=2, vpp=1)
    assert getattr(shared.host, key) == value
    neutral = CostModel.from_dict({**base, "host": {"send": 0.1}}, pp=2, vpp=1)
    assert CostModel.from_dict(neutral.to_dict(), pp=2, vpp=1) == neutral


def test_step_gaps_give_the_steady_state_where_ranks_enter_each_step_at_their_own_time():
    """1F1B pp=2, m=1, F=1, BW=2, a gap of 1 after every rank's step. Started together, rank 1 ends at 4
    and rank 0 at 6, so rank 1 enters the next step 2 earlier; from then on every step is the same:
    rank 1 enters at 0 and waits, rank 0 enters at 2, its BW ends at 8; a step starts every 7."""
    cost = CostModel.per_stage(2, 1, 1, 1, host=HostCost(step_gap=(1.0, 1.0)))
    result = simulate(build_schedule("1f1b", pp=2, microbatches=1), cost)
    assert [r.entered for r in result.ranks] == [2.0, 0.0]
    assert result.step_time == 8.0 and result.period == 7.0
    assert result.timeline().meta["ranks"] == [{"rank": 0, "entered": 2.0}, {"rank": 1, "entered": 0.0}]
    together = simulate(build_schedule("1f1b", pp=2, microbatches=1), CostModel.per_stage(2, 1, 1, 1))
    assert together.step_time == 6.0 and together.period is None


def test_step_gaps_need_one_value_per_rank():
    cost = CostModel.per_stage(2, 1, 1, 1, host=HostCost(step_gap=(1.0, 1.0, 1.0)))
    with pytest.raises(SimulationError, match="host.step_gap has 3 values but the table has 2 ranks"):
        simulate(build_schedule("1f1b", pp=2, microbatches=1), cost)
    model = CostModel.from_dict({"compute": {"f": 1, "b": 1, "w": 1}, "host": {"step_gap": 0.5}}, pp=4, vpp=1)
    assert model.host.step_gap == (0.5,) * 4
