"""``list``, ``show``, ``export`` and ``validate``: the commands that build and check tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.table import Table

from primuspipe.algorithms import list_algorithms, list_aliases
from primuspipe.passes.communication import add_communication
from primuspipe.cli.options import (
    add_shape_arguments,
    console,
    described,
    number_type,
    parse_options,
    report_console,
)
from primuspipe.cli.outputs import STDOUT, Outputs
from primuspipe.errors import ConfigError, ScheduleShapeError, TableFormatError, ValidationError
from primuspipe import strict
from primuspipe.ir.cost_model import CostModel
from primuspipe.passes.offload import offload_activations
from primuspipe.io.formats import TABLE_KINDS, dump_table, load_table, sidecar_path, table_files, table_format
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.activations import W_RETAINED_FRACTION, peak_in_flight
from primuspipe.passes.fifo_weight_grads import check_fifo_weight_grads
from primuspipe.passes.streams import DEFAULT_SEMANTICS, SEMANTICS
from primuspipe.passes.validation import validate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list the registered algorithms and their options",
                       **described("List every registered algorithm (built-in and from the primuspipe.algorithms "
                                   "entry point): its placement, vpp and backward (fused BW or split B and W), the "
                                   "options '-O KEY=VALUE' passes it with their defaults, and a summary; then the "
                                   "other frameworks' names (Primus's) each runs as.",
                                   ["primuspipe list"]))
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("show", help="print an algorithm's schedule grid (and, for the zero-bubble and V-shape "
                                    "family, which construction it chose and its simulated step)",
                       **described("Build an algorithm's validated table for a shape and print it as a grid, one "
                                   "row per rank in run order (F forward, B input-grad, W weight-grad, BW fused "
                                   "backward, with communication unless --compute-only), or as a Graphviz dependency "
                                   "graph (--graph). The zero-bubble and V-shape family also say which construction "
                                   "they chose and its simulated step.",
                                   ["primuspipe show zbv --pp 4 -m 8 --compute-only",
                                    "primuspipe show interleaved-1f1b --pp 4 --vpp 2 -m 8 -O microbatch_group_size=4",
                                    "primuspipe show zb-auto --pp 8 -m 32 --memory-limit 5 --compute-only",
                                    "primuspipe show zbv --pp 4 -m 8 --graph zbv.dot     # then: dot -Tsvg zbv.dot"]))
    p.add_argument("algorithm", help="a registered algorithm ('primuspipe list' names them)")
    add_shape_arguments(p)
    p.add_argument("--compute-only", action="store_true", help="hide communication nodes")
    p.add_argument("--graph", type=Path, nargs="?", const=Path("-"), metavar="FILE",
                   help="write the table's dependency graph as Graphviz DOT instead of the grid: one cluster per "
                        "rank, an edge per transfer (bold, labelled), local hand-off (dashed) and row order; to FILE, "
                        "or standard output without one ('dot -Tsvg FILE' draws it). Nodes are named rank:index, "
                        "the index in the row shown (with --compute-only, the compute-only row)")
    _add_memory_arguments(p)
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("export", help="write an algorithm's validated table as JSON, torch CSV or Primus's table form",
                       **described("Build an algorithm's table for a shape, validate it, and write it: primuspipe "
                                   "JSON (lossless; what 'validate' and the backends read), "
                                   "torch.distributed.pipelining's CSV, or the table lines Primus prints. Nothing is "
                                   "written if the table is invalid.",
                                   ["primuspipe export 1f1b --pp 4 -m 8 --format csv -o 1f1b.csv",
                                    "primuspipe export zb-auto --pp 8 -m 32 --memory-limit 5 -o zb.json",
                                    "primuspipe export zbv --pp 4 -m 8 --format primus -o zbv.txt"]))
    p.add_argument("algorithm", help="a registered algorithm ('primuspipe list' names them)")
    add_shape_arguments(p)
    p.add_argument("--format", choices=("json", "csv", "primus"), default=None,
                   help="json (lossless), torch.distributed.pipelining CSV (with a <file>.meta.json sidecar holding the "
                        "microbatch count and algorithm name) or primus (the 'Rank r: (F|mb|chunk),...' lines Primus's "
                        "debug_scheduler_table prints, after a comment line with the shape; docs/primus.md); default: "
                        "csv for a -o name ending in .csv, else json. A file is named as 'validate' reads it back: "
                        "a CSV ends in .csv, json and primus do not (and primus not in .json)")
    p.add_argument("--compute-only", action="store_true", help="leave out communication nodes")
    p.add_argument("-o", "--output", type=Path, required=True, help="file to write ('-' for stdout)")
    _add_memory_arguments(p)
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("validate", help="check a table file (JSON or CSV); exit 0 only if it is valid",
                       **described("Check a schedule table: every node present once, each rank's order possible, "
                                   "sends paired with receives, no deadlock under the transport (--semantics), "
                                   "optionally a memory bound. A compute-only table is validated as is and again "
                                   "with communication added. Exit status 0 if valid; 1 otherwise, with the rule "
                                   "broken, the grid and the fix.",
                                   ["primuspipe export zbv --pp 4 -m 8 -o zbv.json && primuspipe validate zbv.json",
                                    "primuspipe validate zbv.json --max-in-flight 4",
                                    "primuspipe validate zbv.json --semantics nccl-pair   # would it hang posted "
                                    "unbatched on one NCCL group? (zbv would: exit 1)"]))
    p.add_argument("file", type=Path, help="JSON, torch CSV or Primus's printed table form")
    p.add_argument("--placement", choices=("interleaved", "v"),
                   help="layout of a Primus table that does not say (compute-only, 2 chunks per rank)")
    p.add_argument("--max-in-flight", type=number_type(minimum=0), default=None, metavar="MICROBATCHES",
                   help="also bound activations held per rank (1F1B-stage microbatch units, each counted from its F "
                        "until its W, as simulate's peak and --memory-limit count them)")
    p.add_argument("--w-retained", type=number_type(minimum=0, maximum=1), metavar="SHARE",
                   help="with --max-in-flight: share of a microbatch's activations its B keeps for its W (default "
                        "32/34, see docs/simulator.md)")
    p.add_argument("--semantics", choices=tuple(SEMANTICS), default=DEFAULT_SEMANTICS,
                   help="the transport the deadlock replay models (docs/design.md §3): "
                        + "; ".join(f"{s.name}: {s.summary}" for s in SEMANTICS.values())
                        + f" (default: {DEFAULT_SEMANTICS}, what primuspipe's runner runs)")
    p.add_argument("--fifo-weight-grads", action="store_true",
                   help="also require what Transformer Engine's deferred weight gradients (delay_wgrad_compute) need: "
                        "per rank and chunk, W/BW nodes in the order of the backwards, microbatch 0's first "
                        "(docs/megatron.md)")
    p.set_defaults(handler=cmd_validate)


def _add_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-limit", type=number_type(minimum=None, above=0), metavar="MICROBATCHES",
                   help="per-rank activation budget in 1F1B-stage microbatches, each counted until its W: cost-aware "
                        "algorithms (zb-auto, the zero-bubble and V-shape family) plan within it, as under "
                        "'simulate --memory-limit'")
    p.add_argument("--offload", type=number_type(minimum=None, above=0), metavar="MICROBATCHES",
                   help="run the offload pass: OFFLOAD/RELOAD nodes bring every rank's activations under this many "
                        "1F1B-stage microbatches (docs/offload.md)")
    p.add_argument("--cost", type=Path, metavar="FILE",
                   help="with --offload: the YAML cost model whose compute times, host_link and memory the pass "
                        "plans with (default F = B = W = 1, free copies)")


def _build(args: argparse.Namespace):
    table = build_schedule(args.algorithm, args.pp, args.microbatches, args.vpp, memory_limit=args.memory_limit,
                           **parse_options(args.option))
    if args.cost is not None and args.offload is None:
        raise ConfigError("--cost is read by --offload; give the memory limit with --offload MICROBATCHES")
    if args.offload is not None:
        cost = (CostModel.load(args.cost, pp=table.pp, vpp=table.vpp) if args.cost is not None
                else CostModel.per_stage(table.num_stages, 1, 1, 1))
        table = offload_activations(table, cost, memory_limit=args.offload)
    _check_memory_limit(table, args.memory_limit, args.algorithm)
    return table


def _check_memory_limit(table, limit: float | None, algorithm: str) -> None:
    """A table over ``--memory-limit`` is refused: only cost-aware algorithms plan within the limit, and a
    table shown or written as if it kept to it would be a silent wrong answer."""
    if limit is None:
        return
    peaks = peak_in_flight(table)
    rank = max(range(len(peaks)), key=peaks.__getitem__)
    if peaks[rank] > limit + 1e-9:
        raise ConfigError(f"{algorithm}'s table holds {peaks[rank]:.4g} 1F1B-stage microbatches of activations on rank "
                          f"{rank}, over --memory-limit {limit:g}: give a larger limit, an algorithm that plans within "
                          f"it (zb-auto, v-min), or --offload {limit:g} to bring it under")


def cmd_list(args: argparse.Namespace) -> int:
    table = Table(title="primuspipe algorithms", show_lines=True)
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("placement / vpp / backward", no_wrap=True)
    table.add_column("options (default)", no_wrap=True)
    table.add_column("summary", overflow="fold")
    for info in list_algorithms():
        opts = "\n".join(f"{p.name}={p.default!r}" for p in info.options()) or "-"
        shape = f"{info.placement} / {info.vpp or 'any'} / {'B + W' if info.split_backward else 'BW'}"
        table.add_row(info.name, shape, opts, info.summary)
    console().print(table)
    aliases = Table(title="aliases: other frameworks' names (docs/primus.md)", show_lines=True)
    for column in ("name", "runs", "from", "difference"):
        aliases.add_column(column, no_wrap=column != "difference", overflow="fold")
    for alias in list_aliases():
        fixed = "".join(f" {k}={v!r}" for k, v in alias.options.items()) + (f" vpp={alias.vpp}" if alias.vpp else "")
        aliases.add_row(alias.name, alias.target + fixed, alias.origin, alias.note)
    console().print(aliases)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    if args.graph is not None:
        return _show_graph(args)
    table = _build(args)
    out = report_console()
    out.print(table.grid(compute_only=args.compute_only), markup=False)
    peaks = ", ".join(f"{p:.4g}" for p in peak_in_flight(table))
    out.print(f"peak activations per rank (1F1B-stage microbatches, each counted until its W): {peaks}", markup=False)
    if table.construction is not None:
        out.print(f"construction: {table.construction}", markup=False)
    return 0


def _show_graph(args: argparse.Namespace) -> int:
    from primuspipe.io.dot import to_dot  # networkx loads only for the graph

    outputs = Outputs([args.cost])
    path = outputs.claim(args.graph, "--graph", writes="Graphviz DOT")
    table = _build(args)
    text = to_dot(table.compute_only() if args.compute_only else table)
    if path is None:
        print(text, end="")
        return 0
    outputs.write_text(path, "--graph", text)
    for written in outputs.commit():
        print(f"wrote {strict.shown_path(written)}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    outputs = Outputs([args.cost])
    fmt = args.format or ("json" if str(args.output) == STDOUT else table_format(args.output, None))
    path = outputs.claim(args.output, "-o", writes=TABLE_KINDS[fmt])
    if path is not None and fmt == "csv":
        outputs.claim(sidecar_path(path), "-o's sidecar", writes="JSON")
    table = _build(args)
    if path is None:
        print(dump_table(table, fmt, args.compute_only), end="")
        return 0
    for where, text in table_files(table, path, fmt, args.compute_only).items():
        outputs.write_text(where, "-o", text)
    for written in outputs.commit():
        print(f"wrote {strict.shown_path(written)}", file=sys.stderr)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    if args.w_retained is not None and args.max_in_flight is None:
        raise ConfigError("--w-retained weighs activations for --max-in-flight; add --max-in-flight, or drop it")
    args.w_retained = W_RETAINED_FRACTION if args.w_retained is None else args.w_retained
    out = report_console()
    try:
        table = load_table(args.file, args.placement)
        checks = dict(max_in_flight=args.max_in_flight, retained=args.w_retained, semantics=args.semantics)
        validate(table, **checks)
        if not table.has_communication:
            validate(add_communication(table), **checks)
        if args.fifo_weight_grads:
            check_fifo_weight_grads(table)
    except (ValidationError, TableFormatError, ScheduleShapeError) as exc:
        out.print(strict.printable(strict.paths_shown(f"INVALID {args.file}: {exc}", [args.file])), markup=False)
        return 1
    kind = "full" if table.has_communication else "compute-only"
    out.print(f"valid: {strict.shown_path(args.file)} ({kind} table, {table.algorithm}, pp={table.pp} vpp={table.vpp} "
                  f"microbatches={table.microbatches}; deadlock-free under the {args.semantics} transport semantics)", markup=False)
    return 0
