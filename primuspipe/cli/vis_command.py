"""``vis`` (draw a timeline, or a run beside its simulation) and ``calibrate`` (a cost file from a run)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from primuspipe.cli import sane
from primuspipe.cli.options import count_type, report_console
from primuspipe.cli.outputs import Outputs, same_file
from primuspipe import strict
from primuspipe.errors import ConfigError
from primuspipe.simulator import CostModel
from primuspipe.calibration.accuracy import ReplayAccuracy, replay_accuracy
from primuspipe.calibration.measure import measure_screened
from primuspipe.calibration.measured import MeasuredCosts
from primuspipe.calibration.replay import placement_of
from primuspipe.calibration.runs import screen_runs
from primuspipe.io.timeline import Timeline
from primuspipe.tools import pp_vis
from primuspipe.tools.pp_vis import Comparison, compare_timelines, load_iterations, load_timeline, replay, timeline_stats, write_trace

_INPUT_HELP = ("a timeline JSON file (from 'primuspipe simulate -o DIR'), a run's dump directory holding "
               "iter_<n>/rank_<r>.json (dump_pp_data, e.g. examples/train_gpt.py --dump-dir DIR), or a Primus dump "
               "folder (config.json + pp_rank_<r>.json, from a Primus run or its simulator; docs/primus.md)")

_VIS_DESCRIPTION = """\
Draw a pipeline timeline -- a real run's dump or a simulated step, both in the primuspipe timeline
format -- as a PNG, an interactive HTML page and/or a Perfetto trace, and print its step time, bubble
rate (per rank (step - busy) / step, busy = compute time), mean time per node kind and peak memory.

With --compare SIM_TIMELINE or --cost FILE the input (usually a run) is set beside a simulation of the
same table: the drawings stack the two on one time scale, compute nodes whose position in a rank's
order differs are outlined in red, and a table gives per-kind mean durations, step time, bubble rates
and peak memory side by side. --cost replays the run's own compute order (each rank's nodes in the
order they ran) under the cost model, e.g. one written by 'primuspipe calibrate'."""

_VIS_EPILOG = """\
examples:
  primuspipe simulate -a zbv --pp 4 -m 8 -o sim/ && primuspipe vis sim/zbv.timeline.json --png zbv.png
  primuspipe vis /tmp/pp_data --iteration 2 --png run.png --html run.html --trace run.trace.json
  primuspipe vis output/pp_data --png primus_run.png        # a Primus run's dump_pp_data folder
  primuspipe calibrate /tmp/pp_data -o measured.yaml && primuspipe vis /tmp/pp_data --cost measured.yaml --png cmp.png"""

_CALIBRATE_DESCRIPTION = """\
Measure a cost model from a run's dump and say how well it replays the run. Compute: per model stage
the mean F, B, W and BW node time of each iteration (a chunk's first node of a kind left out: its
extra time is the cold start), then the median over the iterations after the first --warmup ones; FB
nodes give fb_overlap. Host: the time a rank spends before each node of a kind and to post a send or a
receive. P2P: how long the transfers that a node waited for took after both ends were posted. When
the ranks shared a host's cores (more ranks than cores), host.cores says so and times are CPU times
(docs/simulator.md). Writes the YAML that 'primuspipe simulate --cost FILE' reads, in the dump's time
unit (seconds for runs), with the measured peak memory per rank in its header comment (the cost
format has no field for it). Times are written per 1F1B stage (pp values; with vpp chunks, a 1F1B
stage is the sum of its vpp model stages), so the file serves every algorithm at the same pp;
--per-model-stage writes pp*vpp values, exact for the dumped shape only. A run with only fused BW
nodes gets B = W = BW/2 (noted in the file). Several dumps of the same table (runs, sessions) are
pooled; of three or more, a run whose median step lies outside the runs' robust band (modified
z-score over 3.5, and more than about 5 % off their median) met a slow or free moment of the host and
is left out: the notes name it, --json lists it in dropped_runs beside every run's median step.

Then the run's own node order is simulated under the file: each rank's finish (its last node's end
from the step's start, median over the iterations used) beside the run's, and the worst relative
error, step_time_error in --json."""

_CALIBRATE_EPILOG = """\
examples:
  primuspipe calibrate /tmp/pp_data -o measured.yaml
  primuspipe calibrate run1/pp_data run2/pp_data run3/pp_data -o measured.yaml   # three runs pooled
  primuspipe calibrate /tmp/pp_data --json | python -c 'import json,sys; print(json.load(sys.stdin)["step_time_error"])'
  primuspipe simulate --algorithm all --pp 4 -m 8 --cost measured.yaml"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vis", help="draw a run's or a simulation's timeline (PNG, HTML, Perfetto), or compare them",
                       description=_VIS_DESCRIPTION, epilog=_VIS_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="TIMELINE_OR_DUMP_DIR", type=Path, help=_INPUT_HELP)
    p.add_argument("--iteration", type=count_type(minimum=0), metavar="N",
                   help="iteration to draw from a dump directory (default: the typical one -- of the iterations "
                        "after the first, the one whose step time is the median)")
    other = p.add_mutually_exclusive_group()
    other.add_argument("--compare", type=Path, metavar="SIM_TIMELINE",
                       help="a simulated timeline of the same table (pp, vpp, microbatches) to set beside the input")
    other.add_argument("--cost", type=Path, metavar="FILE",
                       help="cost model YAML (see 'primuspipe simulate --help'): simulate the input's own table "
                            "under it and compare")
    _add_placement_argument(p)
    out = p.add_argument_group("outputs (any combination; with none, only the figures are printed)")
    out.add_argument("--png", type=Path, metavar="OUT", help="static PNG: one row per rank, one bar per compute node")
    out.add_argument("--html", type=Path, metavar="OUT",
                     help="interactive HTML (plotly, self-contained): hover shows node, start, end, duration")
    out.add_argument("--trace", type=Path, metavar="OUT",
                     help="Chrome/Perfetto trace JSON of the input (open at https://ui.perfetto.dev); when comparing, "
                          "the simulated one goes next to it as OUT with '.sim' before the extension")
    out.add_argument("--no-comm", action="store_true",
                     help="leave receives (thin grey line: posted -> arrived) out of the PNG")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    p.set_defaults(handler=cmd_vis)

    c = sub.add_parser("calibrate", help="measure a cost model (YAML for 'simulate --cost') from a run's dump",
                       description=_CALIBRATE_DESCRIPTION, epilog=_CALIBRATE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter, intermixed=True)
    c.add_argument("input", metavar="DUMP_DIR", type=Path, nargs="+",
                   help="a run's dump directory or a Primus dump folder (all its iterations are used), or one "
                        "timeline JSON file; several runs of the same table are pooled, each run's warm-up "
                        "skipped, and with three or more a run whose median step lies far outside the others' "
                        "(a slow moment of the host) is left out and named in the notes")
    c.add_argument("-o", "--output", type=Path, metavar="FILE", help="where to write the cost YAML ('-' or none: stdout)")
    c.add_argument("--warmup", type=count_type(minimum=0), default=1, metavar="N",
                   help="leading iterations to skip as warm-up (default 1; all are used if no more remain)")
    c.add_argument("--per-model-stage", action="store_true",
                   help="write pp*vpp per-model-stage values instead of pp per-1F1B-stage ones")
    c.add_argument("--json", action="store_true",
                   help='print {"step_time_error", "per_rank", "step_time", "bubble_rate", "cost_model", ...} as '
                        "JSON: how well the measured model replays the run's own node order (see --help)")
    _add_placement_argument(c)
    c.set_defaults(handler=cmd_calibrate)


def _add_placement_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--placement", choices=("interleaved", "v"),
                        help="stage layout of the run: 'interleaved' or 'v' (default: the one the timeline records, "
                             "else the one its algorithm is registered with); needed only for unregistered algorithms")


def cmd_vis(args: argparse.Namespace) -> int:
    if args.no_comm and args.png is None:
        raise ConfigError("--no-comm leaves receives out of the PNG; add --png OUT, or drop --no-comm")
    outputs = Outputs([args.input, args.compare, args.cost])
    paths = {flag: outputs.claim(getattr(args, flag), f"--{flag}", stdout=False, writes=kind)
             for flag, kind in (("png", "PNG"), ("html", "HTML"), ("trace", "JSON"))}
    sim_trace = None
    if paths["trace"] is not None and (args.compare is not None or args.cost is not None):
        sim_trace = outputs.claim(paths["trace"].with_name(f"{paths['trace'].stem}.sim{paths['trace'].suffix}"),
                                  "--trace (its simulated twin)")
    timeline = _typical(args.input) if args.iteration is None else load_timeline(args.input, args.iteration)
    placement = placement_of(timeline, args.placement)
    comparison = None
    if args.compare is not None:
        comparison = compare_timelines(timeline, load_timeline(args.compare))
    elif args.cost is not None:
        cost = CostModel.load(args.cost, pp=timeline.pp, vpp=timeline.vpp)
        comparison = compare_timelines(timeline, replay(timeline, cost, placement))
    panels = [timeline] if comparison is None else [comparison.run, comparison.simulated]
    marks = frozenset() if comparison is None else comparison.marked_nodes
    if paths["png"] is not None:
        outputs.write(paths["png"], "--png",
                      lambda tmp: pp_vis.draw_png(panels, tmp, marks=marks, show_comm=not args.no_comm))
    if paths["html"] is not None:
        outputs.write(paths["html"], "--html", lambda tmp: pp_vis.write_html(panels, tmp, marks=marks))
    if paths["trace"] is not None:
        outputs.write(paths["trace"], "--trace", lambda tmp: write_trace(timeline, tmp, placement))
    if sim_trace is not None:
        outputs.write(sim_trace, "--trace", lambda tmp: write_trace(comparison.simulated, tmp, placement))
    figures: dict[str, Any] = {"timeline": _stats_json(timeline)}
    if comparison is not None:
        figures["comparison"] = _comparison_json(comparison)
    sane.check(figures, str(args.input), "its times are too large or contradict each other")
    written = outputs.commit()
    if args.json:
        print(sane.json_text({**figures, "written": [str(p) for p in written]}))
        return 0
    console = report_console()
    if comparison is None:
        console.print(_stats_table(timeline))
    else:
        console.print(_comparison_table(comparison))
        _print_order(console, comparison)
    for path in written:
        console.print(f"wrote {strict.shown_path(path)}", markup=False)
    return 0


def _typical(path: Path) -> Timeline:
    """A dump's iteration of median step time among those after the first (one step is noisy: a
    drawing or a comparison of the typical one says more); a timeline file is itself."""
    timelines = load_iterations(path)
    warm = sorted(timelines[1:] or timelines, key=lambda t: t.step_time)
    return warm[(len(warm) - 1) // 2]


def cmd_calibrate(args: argparse.Namespace) -> int:
    outputs = Outputs(args.input)
    output = outputs.claim(args.output, "-o", writes="YAML")
    for i, path in enumerate(args.input):  # a run given twice weighed double in every median and in the screening
        if (twin := next((p for p in args.input[:i] if same_file(p, path)), None)) is not None:
            raise ConfigError(f"{path} is {twin} given again; give each run once")
    screened = screen_runs([load_iterations(path) for path in args.input], args.warmup, [str(p) for p in args.input])
    placement = placement_of(screened.runs[0][0], args.placement)
    measured = measure_screened(screened, placement)
    costs = measured.cost_dict(per_model_stage=args.per_model_stage)
    text = measured.to_yaml(per_model_stage=args.per_model_stage)
    # What is written must read back as the cost model it claims to be (finite times >= 0, one per stage).
    CostModel.from_dict(strict.load_yaml(text, "the measured cost model"), pp=measured.pp, vpp=measured.vpp,
                        source="the measured cost model")
    accuracy = replay_accuracy(screened.used, CostModel.from_dict(costs, pp=measured.pp, vpp=measured.vpp), placement)
    sane.check({**accuracy.to_dict(), "cost_model": costs}, ", ".join(map(str, args.input)),
               "its times are too large or contradict each other")
    if output is not None:
        outputs.write_text(output, "-o", text)
        outputs.commit()
    if args.json:
        print(sane.json_text({**accuracy.to_dict(), "algorithm": measured.algorithm, "pp": measured.pp,
                          "vpp": measured.vpp, "microbatches": measured.microbatches,
                          "iterations": list(measured.iterations), "time_unit": measured.time_unit,
                          "cost_model": costs, "notes": list(measured.notes),
                          "run_steps": list(screened.steps), "dropped_runs": list(measured.dropped_runs),
                          "written": None if output is None else str(output)}))
        return 0
    if output is None:
        print(text, end="")
        return 0
    console = report_console()
    console.print(_measured_table(measured))
    console.print(_accuracy_table(accuracy, measured.time_unit))
    for note in () if args.quiet else measured.notes:
        console.print(f"note: {note}")
    shown = strict.shown_path(args.output)
    console.print(f"wrote {shown}; use it with: primuspipe simulate --cost {shown} "
                  f"--pp {measured.pp} -m {measured.microbatches} --algorithm NAME|all", markup=False)
    return 0


def _stats_json(timeline: Timeline) -> dict[str, Any]:
    s = timeline_stats(timeline)
    return {"source": timeline.source, "algorithm": timeline.algorithm, "pp": timeline.pp, "vpp": timeline.vpp,
            "microbatches": timeline.microbatches, "iteration": timeline.iteration, "time_unit": s.time_unit,
            "step_time": s.step_time, "bubble_rate": s.bubble_rate, "bubble_rate_mean": s.bubble_rate_mean,
            "bubble_rates": list(s.bubble_rates), "kind_means": s.kind_means,
            "kind_cpu_means": s.kind_cpu_means, "peak_memory_bytes": list(s.peak_memory_bytes)}


def _comparison_json(c: Comparison) -> dict[str, Any]:
    return {
        "time_unit": c.run.time_unit,
        "figures": [{"name": f.name, "run": f.run, "simulated": f.simulated, "difference": f.difference}
                    for f in c.figures()],
        "order_differences": [{"rank": d.rank, "index": d.index, "run": d.run and str(d.run),
                               "simulated": d.simulated and str(d.simulated)} for d in c.order_differences],
    }


def _number(value: float | None, name: str = "") -> str:
    if value is None:
        return "-"
    if "bubble" in name:
        return f"{value:.2%}"
    return f"{value:,.0f}" if "bytes" in name else f"{value:.6g}"


def _stats_table(timeline: Timeline) -> Table:
    s = timeline_stats(timeline)
    table = Table(title=f"{timeline.source}: {timeline.algorithm} pp={timeline.pp} vpp={timeline.vpp} "
                        f"m={timeline.microbatches} (iteration {timeline.iteration}): step {s.step_time:.6g} "
                        f"{s.time_unit}, bubble max {s.bubble_rate:.2%} mean {s.bubble_rate_mean:.2%}; "
                        + ", ".join(f"{k} {v:.4g}" for k, v in s.kind_means.items()) + f" {s.time_unit} mean")
    for col in ("rank", f"busy ({s.time_unit})", "bubble rate", "peak memory (bytes)"):
        table.add_column(col, justify="right")
    for rank, busy, rate, peak in zip(s.ranks, s.busy, s.bubble_rates, s.peak_memory_bytes):
        table.add_row(str(rank), f"{busy:.6g}", f"{rate:.2%}", _number(peak, "bytes"))
    return table


def _comparison_table(c: Comparison) -> Table:
    caption = None
    if c.run_stretch > 0.1:
        caption = (f"run nodes lasted up to {c.run_stretch:.0%} longer than their CPU time: ranks waited for a "
                   "core inside them, where the simulator has them wait before; compare the CPU means (the run's "
                   "mean bubble rate counts that wait as busy)")
    # a run set beside another algorithm's simulation names both: the title named the run's alone
    algorithms = c.run.algorithm if c.run.algorithm == c.simulated.algorithm else \
        f"{c.run.algorithm} vs {c.simulated.algorithm}"
    table = Table(title=f"{c.run.source} vs {c.simulated.source}: {algorithms} pp={c.run.pp} vpp={c.run.vpp} "
                        f"m={c.run.microbatches}, times in {c.run.time_unit}", caption=caption)
    for col in ("figure", c.run_stats.label, c.simulated_stats.label, "sim - run", "relative"):
        table.add_column(col, justify="right")
    for f in c.figures():
        rel = f.relative
        table.add_row(f.name, _number(f.run, f.name), _number(f.simulated, f.name), _number(f.difference, f.name),
                      "-" if rel is None else f"{rel:+.1%}")
    return table


def _print_order(console, c: Comparison, limit: int = 20) -> None:
    if not c.order_differences:
        console.print("compute order: identical on every rank")
        return
    console.print(f"compute order differs at {len(c.order_differences)} position(s) "
                  "(outlined in red in the drawings):")
    for d in c.order_differences[:limit]:
        console.print(f"  rank {d.rank} #{d.index}: run {d.run or '-'}, simulated {d.simulated or '-'}")
    if len(c.order_differences) > limit:
        console.print(f"  ... and {len(c.order_differences) - limit} more (--json lists all)")


def _accuracy_table(a: ReplayAccuracy, unit: str) -> Table:
    table = Table(title=f"the run's own node order replayed under these costs: finish per rank ({unit}, median "
                        f"over the iterations used); worst error {a.step_time_error:.1%}")
    for col in ("", "run", "simulated", "error"):
        table.add_column(col, justify="right")
    rows = [(f"rank {r.rank}", r) for r in a.ranks] + [("step time", a.step_time), ("bubble rate", a.bubble_rate)]
    for name, f in rows:
        shown = (lambda x: f"{x:.2%}") if name == "bubble rate" else (lambda x: f"{x:.6g}")
        table.add_row(name, shown(f.measured), shown(f.simulated), f"{f.error:+.1%}")
    return table


def _measured_table(m: MeasuredCosts) -> Table:
    table = Table(title=f"measured from {m.algorithm} pp={m.pp} vpp={m.vpp} m={m.microbatches}, iterations "
                        f"{', '.join(map(str, m.iterations))}; times in {m.time_unit} per model stage")
    for col in ("stage", "F", "B", "W", "BW"):
        table.add_column(col, justify="right")
    for s in range(m.pp * m.vpp):
        bw = "-" if m.fused_backward is None else f"{m.fused_backward[s]:.6g}"
        table.add_row(str(s), f"{m.forward[s]:.6g}", f"{m.backward_input[s]:.6g}", f"{m.backward_weight[s]:.6g}", bw)
    host = ", ".join(f"{k.upper()} {v:.3g}" for k, v in m.host_overhead.items())
    posts = ", ".join(f"{k} {v:.3g}" for k, v in m.host_post.items())
    table.caption = (f"fb_overlap {'-' if m.fb_overlap is None else f'{m.fb_overlap:.3g}'}, p2p latency "
                     f"{'-' if m.p2p_latency is None else f'{m.p2p_latency:.6g}'}"
                     + (f", bandwidth {m.p2p_bandwidth:.6g} B/{m.time_unit}" if m.p2p_bandwidth else "")
                     + f"; host time before a node: {host or '-'}; posting: {posts or '-'}"
                     + (f"; ranks shared {m.cores:g} cores (background {m.background or 0:.3g} of a core per rank "
                        f"off its main thread{f' and {m.message_cpu:.3g} per message' if m.message_cpu else ''}, "
                        f"contention {m.contention or 0:.3g})"
                        if m.cores is not None else "")
                     + "; peak memory per rank (bytes): " + ", ".join(_number(b, "bytes") for b in m.peak_memory_bytes))
    return table
