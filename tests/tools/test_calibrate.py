"""Measured cost models: simulate with known costs -> calibrate -> the same costs and step time."""

import json
from dataclasses import replace

import pytest
import yaml
from simulator_support import simulate_rows

from primuspipe.errors import TableFormatError
from primuspipe.algorithms.build import build_schedule
from primuspipe.cli import main
from primuspipe.ir.cost_model import HostCost
from primuspipe.ir.costs import ComputeCosts
from primuspipe.simulator import CostModel, Link, P2PCost, simulate
from primuspipe.calibration.crowding import REPLAY_TOLERANCE, replayed_cores
from primuspipe.calibration.measure import measure_costs
from primuspipe.calibration.replay import executed_table, placement_of
from primuspipe.tools.pp_vis import load_iterations

P2P = P2PCost(intra_node=Link(0.05), inter_node=Link(0.05))


def _timeline(algorithm, pp, m, vpp, f, b, w, **rest):
    cost = CostModel.per_stage(pp * vpp, f, b, w, p2p=P2P, time_unit="s", **rest)
    return simulate(build_schedule(algorithm, pp, m, vpp, cost=cost), cost)  # as `simulate` builds it


def test_split_backward_costs_are_recovered_per_stage_and_reproduce_the_step(tmp_path, capsys):
    f, b, w = [1.0, 1.25, 0.75, 1.0], [1.5, 2.0, 1.0, 1.5], [0.5, 1.0, 0.75, 0.5]
    result = _timeline("zb-h1", 4, 8, 1, f, b, w)
    measured = measure_costs([result.timeline()])
    assert (measured.forward, measured.backward_input, measured.backward_weight) == (tuple(f), tuple(b), tuple(w))
    assert measured.fused_backward is None and measured.fb_overlap is None
    assert measured.p2p_latency == 0.05
    path = tmp_path / "cost.yaml"
    path.write_text(measured.to_yaml())
    data = yaml.safe_load(path.read_text())
    assert data["compute"] == {"f": f, "b": b, "w": w} and data["time_unit"] == "s"
    (row,) = simulate_rows(capsys, "--algorithm", "zb-h1", "--pp", "4", "-m", "8", "--cost", str(path))
    assert row["step_time"] == pytest.approx(result.step_time, rel=1e-12)


def test_vpp2_file_is_per_1f1b_stage_unless_asked_per_model_stage(tmp_path, capsys):
    f = [0.5, 0.75, 0.5, 0.5, 0.25, 0.5]  # model stages; 1F1B stage k = model stages 2k, 2k+1
    result = _timeline("interleaved-1f1b", 3, 6, 2, f, 0.5, 0.5)
    measured = measure_costs([result.timeline()])
    assert measured.forward == tuple(f)
    assert measured.backward_input == measured.backward_weight == (0.5,) * 6, "BW split in half"
    assert measured.fused_backward == (1.0,) * 6 and any("fused BW" in n for n in measured.notes)
    portable = measured.cost_dict()
    assert portable["compute"]["f"] == [1.25, 1.0, 0.75] and portable["compute"]["bw"] == [2.0, 2.0, 2.0]
    exact = tmp_path / "exact.yaml"
    exact.write_text(measured.to_yaml(per_model_stage=True))
    (row,) = simulate_rows(capsys, "-a", "interleaved-1f1b", "--pp", "3", "--vpp", "2", "-m", "6", "--cost", str(exact))
    assert row["step_time"] == pytest.approx(result.step_time, rel=1e-12)
    # the portable file serves other algorithms of the same pp
    portable_path = tmp_path / "portable.yaml"
    portable_path.write_text(measured.to_yaml())
    (row,) = simulate_rows(capsys, "-a", "1f1b", "--pp", "3", "-m", "6", "--cost", str(portable_path))
    assert row["step_time"] > 0


def test_overlapped_pairs_give_fb_overlap():
    result = _timeline("dualpipe-v", 4, 8, 2, 1.0, [1.0, 2.0] * 4, 0.5, fb_overlap=0.4)
    measured = measure_costs([result.timeline()])
    assert measured.fb_overlap == pytest.approx(0.4)
    assert measured.backward_input == (1.0, 2.0) * 4
    replayed = simulate(executed_table(result.timeline()),
                        CostModel.from_dict(measured.cost_dict(per_model_stage=True), pp=4, vpp=2))
    assert replayed.step_time == pytest.approx(result.step_time)


def test_warmup_is_skipped_and_memory_is_reported(write_dump):
    slow = _timeline("zb-h1", 2, 4, 1, 3.0, 3.0, 3.0).timeline()
    warm = _timeline("zb-h1", 2, 4, 1, 1.0, [1.0, 2.0], 1.0).timeline()
    jitter = _timeline("zb-h1", 2, 4, 1, 1.0, [1.0, 2.0], 1.5).timeline()
    peaks = [3 * 2**30, 2**30]
    dumped = [replace(t, ranks=tuple(replace(r, peak_memory_bytes=peaks[r.rank] + i) for r in t.ranks))
              for i, t in enumerate([slow, warm, warm, jitter])]
    timelines = load_iterations(write_dump(dumped))
    measured = measure_costs(timelines)
    assert measured.iterations == (1, 2, 3)
    assert measured.forward == (1.0, 1.0) and measured.backward_input == (1.0, 2.0)
    assert measured.backward_weight == (1.0, 1.0), "median over iterations ignores the one jittered step"
    assert measured.peak_memory_bytes == (peaks[0] + 3, peaks[1] + 3)
    text = measured.to_yaml()
    assert f"rank 0: {peaks[0] + 3} (3.000 GiB)" in text and "iterations used: 1, 2, 3" in text
    assert measure_costs(timelines, warmup=0).forward == (1.0, 1.0)
    assert measure_costs(timelines[:1]).notes, "a lone iteration is used, with a note"


def test_mismatched_timelines_are_refused():
    a = _timeline("zb-h1", 2, 4, 1, 1, 1, 1).timeline()
    b = _timeline("zb-h1", 2, 6, 1, 1, 1, 1).timeline()
    with pytest.raises(TableFormatError, match="different shapes"):
        measure_costs([a, b])
    with pytest.raises(TableFormatError, match="no timelines"):
        measure_costs([])
    custom = replace(a, algorithm="my-private-schedule", meta={})
    with pytest.raises(TableFormatError, match="--placement interleaved or v"):
        measure_costs([custom])


@pytest.mark.parametrize("layout", ["v", "interleaved"])
def test_a_zb_auto_dump_without_its_placement_is_measured_on_the_layout_its_sends_show(layout):
    """zb-auto chooses its layout per run (registered as "any"), so a dump that records none (an older recorder's,
    a merge before merges kept it) takes the one its sends show -- and a compute-only one, which shows none at
    vpp 2, is refused in one line naming the flag."""
    cost = CostModel.per_stage(4, 1.0, 1.5, 0.5, p2p=P2P, time_unit="s")
    recorded = simulate(build_schedule("zb-auto", 2, 4, 2, cost=cost, placement=layout), cost).timeline()
    older = replace(recorded, meta={k: v for k, v in recorded.meta.items() if k != "placement"})
    assert placement_of(older) == placement_of(recorded) and placement_of(older).name == layout
    assert measure_costs([older]) == measure_costs([recorded])
    compute_only = replace(older, ranks=tuple(replace(r, events=tuple(e for e in r.events if e.node.kind.is_compute))
                                              for r in older.ranks))
    with pytest.raises(TableFormatError, match=r"'zb-auto' chooses one per run.*\(--placement interleaved or v\)$"):
        placement_of(compute_only)


# -- every term of the cost model, recovered exactly from a dump of a step simulated with it ----------
HOST = HostCost(overhead=(("f", 0.0625), ("b", 0.125), ("w", 0.03125)), send=0.09375, recv=0.046875,
                step_gap=(0.5, 1.0, 0.25, 0.75))
COLD = ComputeCosts.per_stage(4, [0.5, 0.25, 0.5, 0.75], 0.25, 0.125)
F, B, W = [1.0, 1.25, 1.0, 1.5], [1.5, 2.0, 1.0, 1.5], [0.5, 1.0, 0.75, 0.5]


@pytest.mark.parametrize("cores", [None, 1.5, 2.0], ids=["a core per rank", "1.5 cores", "2 cores"])
def test_host_latency_cold_start_and_cores_are_recovered_exactly(write_dump, cores):
    """Host overheads per kind, posting times, the gaps between steps, the p2p latency, cold starts
    and the cores ranks share: a steady-state step simulated with them, dumped in the on-disk format
    (three consecutive iterations, ranks' clocks skewed), measured back."""
    cost = CostModel.per_stage(4, F, B, W, p2p=P2P, time_unit="s", host=replace(HOST, cores=cores), cold_start=COLD)
    timeline = simulate(build_schedule("zb-h1", 4, 8, cost=cost), cost).timeline()
    measured = measure_costs(load_iterations(write_dump([timeline] * 3)))
    assert (measured.forward, measured.backward_input, measured.backward_weight) == (tuple(F), tuple(B), tuple(W))
    assert measured.cold_start == {"f": COLD.forward, "b": COLD.backward_input, "w": COLD.backward_weight}
    assert measured.host_overhead == dict(HOST.overhead)
    assert measured.host_post == {"send": HOST.send, "recv": HOST.recv}
    assert measured.p2p_latency == 0.05
    assert measured.cores == cores
    assert measured.step_gap == HOST.step_gap
    file = CostModel.from_dict(measured.cost_dict(), pp=4, vpp=1)
    assert file.host == cost.host and file.cold_start == cost.cold_start
    assert simulate(executed_table(timeline), file).timeline().step_time == pytest.approx(timeline.step_time, rel=1e-9)


def test_a_fused_backward_run_splits_its_cold_start_like_its_time():
    cost = CostModel.per_stage(2, 1.0, 1.0, 1.0, p2p=P2P, time_unit="s", cold_start=ComputeCosts.per_stage(2, 0.5, 0.25, 0.25))
    measured = measure_costs([simulate(build_schedule("1f1b", 2, 6), cost).timeline()])
    assert measured.cold_start == {"f": (0.5, 0.5), "b": (0.25, 0.25), "w": (0.25, 0.25)}, "BW's 0.5 split in half"


@pytest.mark.parametrize("pp, m", [(2, 8), (3, 9), (4, 12)])
@pytest.mark.parametrize("bw_cold", [0.0, 0.375])
def test_a_probed_run_times_its_first_bw_cold_start_apart_from_its_probe_b_and_w(write_dump, pp, m, bw_cold):
    """1F1B with the split probe: a step's first backward is a BW, and the probe's B and W run mid-step. A
    first BW that pays other than B's and W's cold starts together is written as ``cold_start.bw``, so
    plain 1F1B is charged what its first BW paid, and the probed run replays exactly."""
    from primuspipe.passes.split_probe import split_backward_probe

    from primuspipe.passes.communication import add_communication

    table = add_communication(split_backward_probe(build_schedule("1f1b", pp, m).compute_only(), 2))
    cold = ComputeCosts.per_stage(pp, 0.5, 0.125, 0.0625, bw=bw_cold)
    cost = CostModel.per_stage(pp, F[:pp], B[:pp], W[:pp], bw=[b + w - 0.25 for b, w in zip(B, W)][:pp], p2p=P2P,
                               time_unit="s", cold_start=cold)
    timeline = simulate(table, cost).timeline()
    measured = measure_costs(load_iterations(write_dump([timeline] * 2)), warmup=0)
    assert measured.cold_start == {"f": cold.forward, "b": cold.backward_input, "w": cold.backward_weight,
                                   "bw": dict(cold.other)["bw"]}
    file = CostModel.from_dict(measured.cost_dict(), pp=pp, vpp=1)
    assert file.cold_start == cold
    assert simulate(executed_table(timeline), file).step_time == pytest.approx(timeline.step_time, rel=1e-9)
    plain = build_schedule("1f1b", pp, m)
    assert simulate(plain, file).step_time == pytest.approx(simulate(plain, cost).step_time, rel=1e-9)


def test_calibrate_json_reports_how_well_the_model_replays_the_run(write_dump, capsys, tmp_path):
    """The contract of 'primuspipe calibrate DUMP --json': step_time_error is the largest relative error
    of a rank's finish, per_rank lists every rank; a dump of a simulated step replays exactly."""
    cost = CostModel.per_stage(4, F, B, W, p2p=P2P, time_unit="s", host=HOST, cold_start=COLD)
    timeline = simulate(build_schedule("zb-h1", 4, 8, cost=cost), cost).timeline()
    dump = write_dump([timeline, timeline, timeline])
    out = tmp_path / "measured.yaml"
    assert main(["calibrate", str(dump), "--json", "-o", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"step_time_error", "per_rank", "step_time", "bubble_rate", "cost_model", "iterations"} <= set(report)
    assert [r["rank"] for r in report["per_rank"]] == [0, 1, 2, 3]
    assert report["step_time_error"] == max(abs(r["error"]) for r in report["per_rank"])
    assert report["step_time_error"] == pytest.approx(0.0, abs=1e-9)
    assert report["step_time"]["measured"] == pytest.approx(timeline.step_time)
    assert report["iterations"] == [1, 2] and report["written"] == str(out)
    assert yaml.safe_load(out.read_text()) == report["cost_model"]


def test_calibrate_json_error_is_the_worst_rank(write_dump, capsys):
    """Replayed under a model whose F is off on one stage, that stage's rank and those after it finish
    late; the reported error is the largest over ranks, signed per rank."""
    cost = CostModel.per_stage(4, F, B, W, p2p=P2P, time_unit="s")
    run = simulate(build_schedule("1f1b", 4, 8), cost).timeline()
    slower = simulate(build_schedule("1f1b", 4, 8), replace(cost, compute=ComputeCosts.per_stage(4, [1.0, 2.0, 1.0, 1.5], B, W))).timeline()
    from primuspipe.calibration.accuracy import replay_accuracy

    report = replay_accuracy([run], CostModel.from_dict(measure_costs([slower]).cost_dict(), pp=4, vpp=1))
    errors = [r.error for r in report.ranks]
    assert all(e > 0 for e in errors) and report.step_time_error == max(errors)


@pytest.mark.parametrize("background", [0.0625, 0.25])
def test_background_cpu_is_recovered_exactly_and_the_replay_keeps_the_step(background):
    """A simulated dump says, per rank, its process's CPU and its main thread's, as a run's does; their
    difference over the rank's step span is ``host.background`` exactly, and the cores fitted beside it
    make the run's own order replay in the run's step time."""
    host = replace(HOST, cores=1.5, background=background, step_gap=None)
    cost = CostModel.per_stage(4, F, B, W, p2p=P2P, time_unit="s", host=host, cold_start=COLD)
    timeline = simulate(build_schedule("zb-h1", 4, 8, cost=cost), cost).timeline()
    measured = measure_costs([timeline, timeline], warmup=0)
    assert measured.background == background
    assert measured.cores == pytest.approx(1.5, abs=0.05)
    replayed = simulate(executed_table(timeline), CostModel.from_dict(measured.cost_dict(), pp=4, vpp=1))
    assert replayed.step_time == pytest.approx(timeline.step_time, rel=REPLAY_TOLERANCE)


@pytest.mark.parametrize("algorithm, pp", [("1f1b", 3), ("1f1b", 4), ("zb-h1", 4)])
@pytest.mark.parametrize("background, message_cpu", [(0.03125, 0.0625), (0.0625, 0.015625)])
def test_message_cpu_is_told_from_background_where_ranks_send_unequal_counts(algorithm, pp, m=8, *, background,
                                                                             message_cpu):
    """The middle ranks of 1F1B and ZB-H1 send and receive twice the end ranks' messages in about the same
    span: their processes' CPU off the main thread splits exactly into a share of the step and a CPU per
    message, both recovered, and the step replays under them."""
    host = HostCost(cores=pp / 2 + 0.5, background=background, message_cpu=message_cpu)
    cost = CostModel.per_stage(pp, F[:pp], B[:pp], W[:pp], p2p=P2P, time_unit="s", host=host)
    timeline = simulate(build_schedule(algorithm, pp, m, cost=cost), cost).timeline()
    measured = measure_costs([timeline, timeline], warmup=0)
    assert (measured.background, measured.message_cpu) == pytest.approx((background, message_cpu), rel=1e-9)
    assert measured.cost_dict()["host"]["message_cpu"] == measured.message_cpu
    replayed = simulate(executed_table(timeline), CostModel.from_dict(measured.cost_dict(), pp=pp, vpp=1))
    assert replayed.step_time == pytest.approx(timeline.step_time, rel=REPLAY_TOLERANCE)


def test_message_cpu_is_not_fitted_where_every_rank_sends_as_many():
    """At pp = 2 both 1F1B ranks send and receive as many messages in about the same span: the run cannot
    tell a CPU per message from a share of the step, so all of it stays host.background (as a rate it is
    exact for that run) and no host.message_cpu is written."""
    host = HostCost(cores=1.5, background=0.03125, message_cpu=0.0625)
    cost = CostModel.per_stage(2, F[:2], B[:2], W[:2], p2p=P2P, time_unit="s", host=host)
    timeline = simulate(build_schedule("1f1b", 2, 8, cost=cost), cost).timeline()
    measured = measure_costs([timeline, timeline], warmup=0)
    assert measured.message_cpu is None and "message_cpu" not in measured.cost_dict()["host"]
    assert measured.background > 0.03125


@pytest.mark.parametrize("contention", [0.05, 0.2])
def test_contention_is_measured_from_a_crowded_run_and_the_replay_keeps_the_step(contention):
    """Four ranks on 1.5 cores: nodes that ran while more ranks were busy took more CPU; calibrate fits the
    share (the dump draws a node compressed to its CPU time, so the crowding it sees is close, not
    exact), takes compute times at no crowding, and the run's own order replays in its step time."""
    host = HostCost(cores=1.5, background=0.05, contention=contention)
    cost = CostModel.per_stage(4, [1.0, 1.2, 1.1, 1.3], [1.0, 1.1, 1.0, 1.2], [0.5, 0.6, 0.5, 0.7], time_unit="s",
                               p2p=replace(P2P, ranks_per_node=4), host=host)
    timeline = simulate(build_schedule("zb-h1", 4, 8, cost=cost), cost).timeline()
    measured = measure_costs([timeline, timeline], warmup=0)
    assert measured.contention == pytest.approx(contention, rel=0.15)
    assert measured.forward == pytest.approx((1.0, 1.2, 1.1, 1.3), rel=0.06)  # at no crowding
    replayed = simulate(executed_table(timeline), CostModel.from_dict(measured.cost_dict(), pp=4, vpp=1))
    assert replayed.step_time == pytest.approx(timeline.step_time, rel=REPLAY_TOLERANCE)


def test_no_contention_is_fitted_where_every_rank_has_a_core():
    """Two ranks on 1.9 cores are never crowded beyond a tenth of a rank: the run cannot tell contention
    from the nodes' own times, and none is written."""
    cost = CostModel.per_stage(2, F[:2], B[:2], W[:2], p2p=P2P, time_unit="s",
                               host=HostCost(cores=1.9, contention=0.3))
    measured = measure_costs([simulate(build_schedule("zb-h1", 2, 8, cost=cost), cost).timeline()] * 2, warmup=0)
    assert measured.cores is not None and measured.contention is None
    assert "contention" not in measured.cost_dict()["host"]


@pytest.mark.parametrize("algorithm, pp, m, cores", [("1f1b", 2, 2, 1.9), ("1f1b", 2, 8, 2.0), ("zb-h1", 3, 3, 2.5),
                                                     ("zbv", 2, 4, 1.9), ("1f1b", 4, 8, 1.5)])
@pytest.mark.parametrize("speed", [0.8, 0.95])
def test_host_speed_is_measured_from_the_nodes_that_ran_alone(write_dump, algorithm, pp, m, cores, speed):
    """Ranks that get ``speed`` of a core even alone (``host.speed``): calibrate reads it from the nodes
    that ran while no other rank was busy (CPU over wall), writes it beside the cores, and the run's own
    order replays in its step time; without it, a step whose bubbles are long replays fast."""
    n = build_schedule(algorithm, pp, m).placement.num_stages
    host = replace(HOST, cores=cores, speed=speed, step_gap=None)
    cost = CostModel.per_stage(n, F[:n], B[:n], W[:n], p2p=replace(P2P, ranks_per_node=pp), time_unit="s", host=host,
                               cold_start=ComputeCosts.per_stage(n, COLD.forward[:n], 0.25, 0.125))
    timeline = simulate(build_schedule(algorithm, pp, m, cost=cost), cost).timeline()
    measured = measure_costs(load_iterations(write_dump([timeline] * 3)), warmup=0)
    assert measured.speed == pytest.approx(speed, rel=0.01)
    data = measured.cost_dict(per_model_stage=True)
    assert data["host"]["speed"] == measured.speed
    model = CostModel.from_dict(data, pp=pp, vpp=timeline.vpp)
    assert model.host.speed == measured.speed
    replayed = simulate(executed_table(timeline), model).step_time
    assert replayed == pytest.approx(timeline.step_time, rel=REPLAY_TOLERANCE)


def test_no_host_speed_where_ranks_alone_got_a_whole_core(write_dump):
    cost = CostModel.per_stage(2, F[:2], B[:2], W[:2], p2p=P2P, time_unit="s", host=HostCost(cores=1.9))
    measured = measure_costs(load_iterations(write_dump([simulate(build_schedule("1f1b", 2, 4), cost).timeline()] * 2)),
                             warmup=0)
    assert measured.cores is not None and measured.speed is None and "speed" not in measured.cost_dict()["host"]


def test_cores_the_replay_contradicts_are_refitted_on_it():
    """A core count under which the run's own order would replay too slowly (or too fast) is refitted:
    the replay then takes the run's step time."""
    cost = CostModel.per_stage(4, F, B, W, p2p=P2P, time_unit="s", host=replace(HOST, cores=1.5, step_gap=None))
    timeline = simulate(build_schedule("zb-h1", 4, 8, cost=cost), cost).timeline()
    measured = measure_costs([timeline], warmup=0)
    for wrong in (0.75, 3.0):
        refit = replayed_cores(replace(measured, cores=wrong), [timeline], placement_of(timeline))
        model = CostModel.from_dict(replace(measured, cores=refit).cost_dict(), pp=4, vpp=1)
        assert simulate(executed_table(timeline), model).step_time == pytest.approx(timeline.step_time, rel=0.005)
        assert refit == pytest.approx(1.5, abs=0.05)


def test_a_transfer_timed_as_float_noise_is_no_latency():
    """Transfers whose arrival and posting readings agree but for float noise (2e-12 s beside 10 ms nodes;
    a real CPU run gave 1.5e-13 s beside 9 ms) give latency 0, not a file the cost model refuses."""
    from primuspipe.calibration.walk import walk

    timeline = _timeline("1f1b", 2, 4, 1, 0.01, 0.01, 0.01).timeline()
    noisy = {}
    for step in walk(timeline, placement_of(timeline)):
        if step.waited is not None:  # the transfer arrived as its later end was posted, but for the noise
            send, recv = step.waited
            noisy[recv.node] = replace(recv, end=max(send.start, recv.start) + 2e-12)
    assert noisy
    ranks = tuple(replace(rt, events=tuple(noisy.get(e.node, e) for e in rt.events)) for rt in timeline.ranks)
    measured = measure_costs([replace(timeline, ranks=ranks)])
    assert measured.p2p_latency == 0.0 and measured.forward == (0.01, 0.01)
    assert any("taken as no latency" in note for note in measured.notes)
    CostModel.from_dict(measured.cost_dict(), pp=2, vpp=1)  # a file the simulator reads


@pytest.mark.parametrize("pp, m", [(2, 8), (3, 9), (4, 8), (4, 12)])
@pytest.mark.parametrize("share", [0.125, 0.4])
def test_a_probed_runs_window_extra_is_recovered_exactly_and_both_tables_replay(write_dump, pp, m, share):
    """1F1B with the split probe, whose nodes in a window (a deferred W pending) cost more, by a share
    that differs by rank: calibrate writes each rank's as ``compute.probe_window`` and times F, B and BW
    from the other nodes, so the probed run replays exactly and plain 1F1B (no window) and ZB-H1 (its
    ranks' deferred Ws) are predicted as their true costs give them."""
    shares = tuple(share / (1 + rank) for rank in range(pp))
    from primuspipe.passes.communication import add_communication
    from primuspipe.passes.split_probe import split_backward_probe

    probed = add_communication(split_backward_probe(build_schedule("1f1b", pp, m).compute_only(), 2))
    truth = CostModel.per_stage(pp, F[:pp], B[:pp], W[:pp], bw=[b + w - 0.25 for b, w in zip(B, W)][:pp], p2p=P2P,
                                time_unit="s", probe_window=shares, host=replace(HOST, step_gap=None),
                                cold_start=ComputeCosts.per_stage(pp, COLD.forward[:pp], 0.25, 0.125))
    timeline = simulate(probed, truth).timeline()
    measured = measure_costs(load_iterations(write_dump([timeline] * 2)), warmup=0)
    assert measured.probe_window == pytest.approx(shares, rel=1e-9)
    assert measured.forward == tuple(F[:pp]) and measured.backward_input == tuple(B[:pp])
    file = CostModel.from_dict(measured.cost_dict(), pp=pp, vpp=1)
    assert file.probe_window == pytest.approx(shares, rel=1e-9)
    replayed = simulate(executed_table(timeline), file).timeline()
    assert replayed.step_time == pytest.approx(timeline.step_time, rel=1e-9)
    for algorithm in ("1f1b", "zb-h1"):
        table = build_schedule(algorithm, pp, m)
        assert simulate(table, file).step_time == pytest.approx(simulate(table, truth).step_time, rel=1e-9)


@pytest.mark.parametrize("pp, m, cores", [(2, 8, 1.9), (3, 9, 2.0), (4, 8, 2.0), (4, 12, 1.5)])
def test_cores_shared_beside_a_probe_window_are_not_raised_to_pay_for_it(write_dump, pp, m, cores):
    """Ranks sharing cores, the probe's window nodes 15 % longer in CPU: the cores are fitted as shared, not
    raised so that a faster forward replays the probed run, and plain 1F1B is predicted as its true costs
    give it (a file that took the window into F and the cores predicted it fast)."""
    from primuspipe.passes.communication import add_communication
    from primuspipe.passes.split_probe import split_backward_probe

    probed = add_communication(split_backward_probe(build_schedule("1f1b", pp, m).compute_only(), 2))
    truth = CostModel.per_stage(pp, F[:pp], B[:pp], W[:pp], bw=[b + w - 0.25 for b, w in zip(B, W)][:pp],
                                p2p=replace(P2P, ranks_per_node=pp), time_unit="s", probe_window=0.15,
                                host=replace(HOST, cores=cores, step_gap=None))
    timeline = simulate(probed, truth).timeline()
    measured = measure_costs(load_iterations(write_dump([timeline] * 2)), warmup=0)
    assert measured.probe_window == pytest.approx((0.15,) * pp, rel=1e-6)
    assert measured.cores == pytest.approx(cores, abs=0.05)
    file = CostModel.from_dict(measured.cost_dict(), pp=pp, vpp=1)
    replayed = simulate(executed_table(timeline), file).timeline()
    assert replayed.step_time == pytest.approx(timeline.step_time, rel=REPLAY_TOLERANCE)
    plain = build_schedule("1f1b", pp, m)
    assert simulate(plain, file).step_time == pytest.approx(simulate(plain, truth).step_time, rel=REPLAY_TOLERANCE)


def test_a_run_without_probe_windows_writes_no_share():
    cost = CostModel.per_stage(2, F[:2], B[:2], W[:2], p2p=P2P, time_unit="s", probe_window=0.5)
    for algorithm in ("1f1b", "zb-h1"):
        measured = measure_costs([simulate(build_schedule(algorithm, 2, 6), cost).timeline()] * 2)
        assert measured.probe_window is None and "probe_window" not in measured.cost_dict()["compute"]


def test_a_recorded_placement_of_another_shape_is_refused_in_one_line():
    """A timeline's meta.placement is checked against its pp / vpp wherever it is read (it was taken as
    written by calibration, and failed later, elsewhere, or mapped chunks to the wrong stages)."""
    from primuspipe.ir.placement import Placement

    timeline = _timeline("1f1b", 2, 4, 1, 0.01, 0.01, 0.01).timeline()
    assert placement_of(timeline) == Placement.named("interleaved", 2, 1)
    wrong = replace(timeline, meta={**timeline.meta, "placement": Placement.named("interleaved", 4, 1).to_dict()})
    with pytest.raises(TableFormatError, match="pp=2 vpp=1 but its meta.placement is pp=4 vpp=1"):
        measure_costs([wrong])
