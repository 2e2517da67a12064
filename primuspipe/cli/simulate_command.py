"""``simulate``: time one algorithm, or all of them, under a cost model and rank them."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from primuspipe.algorithms import ScheduleRequest, get_algorithm, list_algorithms
from primuspipe.cli.options import (
    add_shape_arguments,
    number_type,
    numbers_type,
    output_dir,
    parse_options,
    report_console,
)
from primuspipe.cli import sane
from primuspipe.cli.outputs import Outputs
from primuspipe.errors import ConfigError, PrimusPipeError
from primuspipe.algorithms.build import build_schedule, check_options, offload_options
from primuspipe.ir.kinds import NodeKind
from primuspipe.passes.offload import offload_activations
from primuspipe.passes.streams import DEFAULT_SEMANTICS, SEMANTICS
from primuspipe.ir.limits import check_shape
from primuspipe.ir.table import Construction
from primuspipe.search.zb_auto import ZbAutoReport, zb_auto_search
from primuspipe.simulator import CostModel, SimulationResult, read_cost_file, simulate
from primuspipe.simulator.trace import write_chrome_trace

_DESCRIPTION = """\
Build each algorithm's table for the shape, simulate it under a cost model, and rank the algorithms by
step time. Compute times come from --cost FILE (YAML, see primuspipe.ir.cost_model) or from
--f/--b/--w (default 1 each); an algorithm with fused backward (BW) nodes costs BW = B + W unless --bw
or the file says otherwise. Times are those of a 1F1B stage (the model split pp ways): an algorithm with
vpp chunks per rank runs each chunk in 1/vpp of it, so algorithms of different vpp compare fairly.
A comma list gives one value per 1F1B stage (pp values), or per model stage (pp*vpp values).
Communication is free unless --p2p or the file's p2p section costs it. Cost-aware algorithms (zero-bubble
family, V-shapes, zb-auto) plan with the very cost model they are simulated with, unless --plan-cost says
what the run plans with: a runner given no costs (the Megatron backend without pp_cost_* or
algorithm_options.cost) plans with unit costs, '--plan-cost unit', and its table can differ from the one
planned with measured costs.
Bubble rate is (step - busy) / step per rank (max and mean over ranks); 'bubble (span)' (bubble_rate_span
in --json) measures each rank over its own first-to-last compute, the zero-bubble papers' figure.
Peak activations are in microbatches of one 1F1B stage (a chunk's forward counts 1/vpp), each held from its F
until its W, at the share W keeps of it (memory.w_retained_fraction, default 32/34 = 0.94: flash attention)
between its B and its W: what the device holds. --memory-limit, 'fits' and 'primuspipe validate
--max-in-flight' count the same way. zb-auto searches every placement (interleaved vpp 1 and 2, and the
V) unless --vpp or -O placement=... pins one, and reports how it found its table. An algorithm that
picks among candidate constructions (the zero-bubble and V-shape family) reports which one it built, its
simulated step under the costs it planned with, and the step of its paper's schedule ('construction' in
--json).
--offload runs the offload pass on each table whose peak is over --memory-limit: OFFLOAD/RELOAD nodes move
the activations of microbatches with long F-to-B gaps to host memory and back (docs/offload.md); the host
link comes from the cost file's host_link section or --host-link, and the step time shows what the copies
cost (a backward waiting for its reload). zb-auto then also weighs every fixed table over the limit with
the pass's copies (-O offload=true) against its own constructions, so it is never behind the best row."""

_EPILOG = """\
examples:
  primuspipe simulate --algorithm all --pp 8 --vpp 2 -m 32
  primuspipe simulate --algorithm 1f1b --pp 4 -m 8 --f 1 --b 1,1,2,1 --w 1 --p2p 0.1 -o out/
  primuspipe simulate --algorithm all --pp 8 -m 32 --cost costs.yaml --memory-limit 8 --json
  primuspipe simulate --algorithm zb-auto --pp 8 -m 24 --f 1 --b 1.5 --w 0.5 --memory-limit 5
  primuspipe simulate --algorithm v-half --pp 8 -m 32 --memory-limit 4 --offload --host-link 0.01,2"""


_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".csv", ".txt", ".png", ".html")
"""Names -o refuses for a directory it would create: export's and calibrate's -o writes one such file, and
``simulate -o x.json`` made a directory x.json instead of the file the user meant."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate algorithms under a cost model and rank them by step time",
                       description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", "-a", action="single", required=True, metavar="NAME|all",
                   help="a registered algorithm (see 'primuspipe list') or 'all' to compare every one")
    add_shape_arguments(p)
    costs = p.add_argument_group("costs (use --cost FILE, or the flags below; times in any one unit, the cost "
                                 "file's time_unit, and the step time is printed in it)")
    costs.add_argument("--cost", type=Path, metavar="FILE",
                       help="YAML cost model: compute times, p2p links, memory bytes "
                            "(see primuspipe.ir.cost_model)")
    costs.add_argument("--plan-cost", metavar="FILE|unit",
                       help="the cost model cost-aware algorithms plan their tables with, when the run plans with "
                            "other costs than it is timed with: 'unit' (F = B = W = 1 per stage: what a runner "
                            "given no costs uses) or a YAML cost file; default: the simulated costs")
    for flag, what in (("f", "forward (F)"), ("b", "input-grad backward (B)"), ("w", "weight-grad backward (W)")):
        costs.add_argument(f"--{flag}", type=numbers_type, metavar="X",
                           help=f"{what} time of a 1F1B stage: one number, or a comma list with one per stage "
                                "(default 1)")
    costs.add_argument("--bw", type=numbers_type, metavar="X",
                       help="fused backward (BW) time, one number or one per stage (default B + W)")
    costs.add_argument("--p2p", type=number_type(minimum=0), metavar="X",
                       help="time of every cross-rank transfer (replaces the cost file's p2p section; default 0)")
    costs.add_argument("--w-retained", type=number_type(minimum=0, maximum=1), metavar="SHARE",
                       help="share of a microbatch's activations its B keeps for its W (replaces the cost file's "
                            "memory.w_retained_fraction; default 32/34, see docs/simulator.md)")
    p.add_argument("--memory-limit", type=number_type(minimum=None, above=0), metavar="MICROBATCHES",
                   help="per-rank activation budget in 1F1B-stage microbatches, each counted until its W: passed to "
                        "cost-aware algorithms, and any algorithm whose peak exceeds it is marked as not fitting")
    p.add_argument("--memory-limit-bytes", type=number_type(minimum=0), metavar="BYTES",
                   help="per-rank activation budget in bytes, counted as the simulator's byte peak counts them (a "
                        "split B's rise and what W keeps beyond the retained share included; needs the cost file's "
                        "memory.activation_bytes): passed to cost-aware algorithms (zb-auto keeps only tables within "
                        "it), and any algorithm whose byte peak exceeds it is marked as not fitting")
    p.add_argument("--offload", action="store_true",
                   help="insert OFFLOAD/RELOAD nodes (the offload pass) into each table over --memory-limit, "
                        "so it fits; the row's 'offloads' counts them")
    costs.add_argument("--host-link", type=numbers_type, metavar="LATENCY,BANDWIDTH",
                       help="device<->host copy link for --offload: latency in time units, bandwidth in bytes per time "
                            "unit (replaces the cost file's host_link; default free). A copy moves a chunk's "
                            "memory.activation_bytes (from --cost) times memory.offload_fraction; without bytes "
                            "it takes the latency alone")
    p.add_argument("--semantics", choices=tuple(SEMANTICS), default=DEFAULT_SEMANTICS,
                   help="the transport whose streams time the sends and receives (docs/simulator.md): "
                        + "; ".join(f"{s.name}: {s.summary}" for s in SEMANTICS.values())
                        + f" (default: {DEFAULT_SEMANTICS}, what primuspipe's runner runs). A table that cannot "
                          "complete under it is reported with the cycle of waits, as 'primuspipe validate "
                          "--semantics' reports it")
    p.add_argument("-o", "--output-dir", type=Path, metavar="DIR",
                   help="write ALGORITHM.timeline.json (primuspipe timeline) and ALGORITHM.trace.json "
                        "(Chrome/Perfetto trace) for each simulated algorithm into DIR. Unlike export's and "
                        "calibrate's -o (--output, one file), -o here names a directory; a new DIR named like a "
                        "file (x.json) is refused: the ranking as JSON is --json > x.json")
    p.add_argument("--json", action="store_true",
                   help='print {"results": [...]} as JSON instead of a table; algorithms refused for the shape carry "error" '
                        '(when none could be simulated: one error line and exit 1, as without --json)')
    p.set_defaults(handler=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    spec = _cost_spec(args)
    plan_spec = None if args.plan_cost in (None, "unit") else read_cost_file(args.plan_cost)
    options = parse_options(args.option)
    if args.algorithm == "all":
        names = [info.name for info in list_algorithms()]
    else:
        names = [get_algorithm(args.algorithm).name]
    outputs = Outputs([args.cost, None if args.plan_cost == "unit" else args.plan_cost])
    if args.output_dir is not None:
        if str(args.output_dir) == "-":
            raise ConfigError("-o - means standard output, but simulate -o writes a directory of files; give a "
                              "directory (use --json for the results on standard output)")
        if args.output_dir.suffix.lower() in _FILE_SUFFIXES and not args.output_dir.is_dir():
            raise ConfigError(f"simulate -o (--output-dir) writes a directory of files, and {args.output_dir} is named "
                              "like one file (export's and calibrate's -o); for the results in a file use --json > "
                              f"{args.output_dir}, or create the directory first to use that name")
        output_dir(args.output_dir, "-o")
        for name in names:
            for suffix in ("timeline", "trace"):
                outputs.claim(args.output_dir / f"{name}.{suffix}.json", "-o")
    rows, results = [], {}
    for name in names:
        row, result = _evaluate(name, args, spec, plan_spec, options)
        rows.append(row)
        if result is not None:
            results[name] = result
    rows.sort(key=lambda r: ("error" in r, r.get("step_time", 0.0), r["algorithm"]))
    if not results:  # nothing to rank, in a table or as JSON: the reason(s), on one error line
        reasons = dict.fromkeys(row["error"].splitlines()[0] for row in rows)
        raise ConfigError(next(iter(reasons)) if len(reasons) == 1 else
                          "no algorithm could be simulated: " + "; ".join(reasons))
    if args.output_dir is not None:
        for name, result in results.items():
            timeline = result.timeline()
            outputs.write(args.output_dir / f"{name}.timeline.json", "-o", timeline.save)
            outputs.write(args.output_dir / f"{name}.trace.json", "-o",
                          lambda tmp, t=timeline, p=result.table.placement: write_chrome_trace(tmp, t, p))
        outputs.commit()
    if args.json:
        print(sane.json_text({"results": rows}))
    else:
        _print_table(rows, args)
    return 0


def _cost_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The cost model in its YAML form, before it is resolved per algorithm's shape."""
    flags = {k: getattr(args, k) for k in ("f", "b", "w", "bw") if getattr(args, k) is not None}
    if args.cost is not None:
        if flags:
            raise ConfigError(f"give compute times either in --cost {args.cost} or as --f/--b/--w/--bw, not both")
        spec = read_cost_file(args.cost)
    else:
        spec = {"compute": {"f": 1.0, "b": 1.0, "w": 1.0, **flags}}
    if args.p2p is not None:
        spec = {**spec, "p2p": {"intra_node": {"latency": args.p2p}, "inter_node": {"latency": args.p2p}}}
    if args.w_retained is not None:
        spec = {**spec, "memory": {**spec.get("memory", {}), "w_retained_fraction": args.w_retained}}
    if args.offload and args.memory_limit is None:
        raise ConfigError("--offload brings tables under --memory-limit; give the limit (1F1B-stage microbatches)")
    if args.host_link is not None:
        if not args.offload:
            raise ConfigError("--host-link is the link --offload copies over; add --offload (and --memory-limit), or "
                              "drop --host-link")
        link = args.host_link if isinstance(args.host_link, list) else [args.host_link]
        if len(link) != 2:
            raise ConfigError(f"--host-link takes LATENCY,BANDWIDTH, got {args.host_link}")
        if link[1] <= 0:
            raise ConfigError(f"--host-link {link[0]:g},{link[1]:g}: the bandwidth (bytes per time unit) must be > 0; "
                              "leave --host-link out for a free link")
        spec = {**spec, "host_link": {"latency": link[0], "bandwidth": link[1]}}
    # the costs as given, checked once before any algorithm is built (each then cuts them to its vpp)
    source = _cost_source(args)
    lengths = [len(v) for v in (spec.get("compute") or {}).values() if isinstance(v, list) and len(v) % args.pp == 0]
    try:
        model = CostModel.from_dict(spec, pp=args.pp, vpp=args.vpp or max([1, *(n // args.pp for n in lengths)]),
                                    source=source)
    except ConfigError as exc:
        raise ConfigError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from None
    if args.memory_limit_bytes is not None and not model.memory.models_bytes:
        raise ConfigError(f"--memory-limit-bytes counts activation bytes, which {source} does not give; add "
                          "memory.activation_bytes (per stage) to the --cost file, or give --memory-limit in microbatches")
    return spec


def _cost_source(args: argparse.Namespace) -> str:
    """What error messages call the costs: the file, or the flags that gave them."""
    if args.cost is not None:
        return str(args.cost)
    flags = [f"--{k.replace('_', '-')}" for k in ("f", "b", "w", "bw", "p2p", "host_link") if getattr(args, k) is not None]
    return f"the costs of {'/'.join(flags)}" if flags else "the default costs"


def _plan_cost(args: argparse.Namespace, plan_spec: dict | None, vpp: int, cost: CostModel) -> CostModel | None:
    """What cost-aware algorithms plan with: ``--plan-cost`` (``unit``: None, ``build_schedule``'s
    F = B = W = 1 per stage, as for a runner given no costs; a file: ``plan_spec``, read once), else the
    simulated model itself."""
    if args.plan_cost is None:
        return cost
    if plan_spec is None:
        return None
    return CostModel.from_dict(plan_spec, pp=args.pp, vpp=vpp, source=args.plan_cost)


def _evaluate(name: str, args: argparse.Namespace, spec: dict, plan_spec: dict | None,
              options: dict) -> tuple[dict, SimulationResult | None]:
    vpp = get_algorithm(name).resolve_vpp(args.vpp)
    row: dict[str, Any] = {"algorithm": name, "pp": args.pp, "vpp": vpp, "microbatches": args.microbatches}
    try:
        check_shape(args.pp, vpp or 2, args.microbatches)
        cost = CostModel.from_dict(spec, pp=args.pp, vpp=vpp or 1,
                                   source=_cost_source(args))
        plan = _plan_cost(args, plan_spec, vpp or 1, cost)
        # under --offload zb-auto plans the fixed tables' offload itself, so it weighs them as the rows below
        # do (a fixed table over the limit plus its copies) against its own constructions
        options, offload_pass = offload_options(name, options) if args.offload else (options, False)
        if name == "zb-auto":  # the search's report is shown beside its table
            options = check_options(name, options)
            request = ScheduleRequest(args.pp, vpp, args.microbatches, plan, args.memory_limit, args.memory_limit_bytes)
            table, report = zb_auto_search(request, **options)
        else:
            table = build_schedule(name, args.pp, args.microbatches, vpp, cost=plan, memory_limit=args.memory_limit,
                                   memory_limit_bytes=args.memory_limit_bytes, **options)
        cost = cost.for_shape(args.pp, table.vpp)
        if offload_pass:
            table = offload_activations(table, cost, memory_limit=args.memory_limit)
        result = simulate(table, cost, args.semantics)
        figures = {"step_time": result.step_time, "bubble_rate": result.bubble_rate,
                   "bubble_rate_mean": result.bubble_rate_mean, "bubble_rate_span": result.span_bubble_rate,
                   "peak_memory_bytes": max(result.peak_memory_bytes)}
        sane.check(figures, name, "the costs are too large for a step's sum to be a number; give smaller "
                                  "times (or another --cost time_unit)")
    except PrimusPipeError as exc:
        return {**row, "error": str(exc)}, None
    if name == "zb-auto":
        row["search"] = sane.check(asdict(report), name)
    if table.construction is not None:
        row["construction"] = table.construction.to_dict()
    peak = max(result.peak_activations)
    row.update(
        vpp=table.vpp, placement=table.placement.name,
        step_time=result.step_time, bubble_rate=result.bubble_rate, bubble_rate_mean=result.bubble_rate_mean,
        bubble_rate_span=result.span_bubble_rate,
        peak_activations=result.peak_activations, peak_memory_bytes=max(result.peak_memory_bytes),
        w_retained_fraction=cost.memory.w_retained_fraction,
        fits=(args.memory_limit is None or peak <= args.memory_limit + 1e-9) and (
            args.memory_limit_bytes is None
            or max(r.peak_activation_bytes for r in result.ranks) <= args.memory_limit_bytes * (1 + 1e-9)),
    )
    if args.offload:
        row["offloads"] = sum(n.kind is NodeKind.OFFLOAD for r in table.ranks for n in r)
    return row, result


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    limit = "" if args.memory_limit is None else f", memory limit {args.memory_limit:g} microbatches"
    if args.memory_limit_bytes is not None:
        limit += f", activation limit {args.memory_limit_bytes:g} bytes"
    table = Table(title=f"pp={args.pp} microbatches={args.microbatches}{limit}, ranked by step time")
    table.add_column("#", justify="right")
    table.add_column("algorithm", no_wrap=True)
    columns = ["vpp", "step time", "bubble max", "bubble mean", "bubble (span)", "peak act. (mb)", "peak memory", "fits"]
    if args.offload:
        columns.append("offloads")
    for col in columns:
        table.add_column(col, justify="right")
    refused = []
    steps = [row["step_time"] for row in rows if "error" not in row]
    for row in rows:
        if "error" in row:
            refused.append(row)
            continue
        rank = 1 + sum(step < row["step_time"] - 1e-9 for step in steps)  # equal step times share a rank
        memory = f"{row['peak_memory_bytes'] / 2**30:.2f} GiB" if row["peak_memory_bytes"] else "-"
        vpp = f"{row['vpp']} V" if row["placement"] == "v" else str(row["vpp"])
        cells = [str(rank), row["algorithm"], vpp, f"{row['step_time']:g}", f"{row['bubble_rate']:.4f}",
                 f"{row['bubble_rate_mean']:.4f}", f"{row['bubble_rate_span']:.4f}",
                 f"{max(row['peak_activations']):.4g}", memory, "yes" if row["fits"] else "OVER"]
        table.add_row(*cells, *([str(row["offloads"])] if args.offload else []))
    console = report_console()
    console.print(table)
    for row in rows:
        if "search" in row:
            console.print(f"zb-auto found it as {ZbAutoReport(**row['search']).summary}")
        if "construction" in row:
            console.print(f"how {row['algorithm']} was built (timed with its planning costs): "
                          f"{Construction(**row['construction'])}", markup=False)
    for row in refused:
        reason = row["error"].splitlines()[0]
        console.print(f"not simulated: {row['algorithm']} (vpp={row['vpp']}): {reason}")
