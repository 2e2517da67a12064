"""Reading and writing tables: JSON (lossless, ours) and torch.distributed.pipelining's CSV actions.

The CSV format has one row per rank and one action per cell, written as ``{stage}{type}{microbatch}``
(``2F0``, ``1I3``, ``0SEND_F1``; ``B`` is torch's full backward, ``I`` its input-grad backward) and
``({a};{b})OVERLAP_F_B`` for an overlapped pair: an ``F`` with an ``I`` is our ``FB`` node, an ``F``
with a ``B`` (what torch's DualPipeV writes) our ``FBW``. Torch names global stages and leaves peers
implicit, so reading a CSV infers the placement from which rank runs which stage.

Torch also writes cells that are not nodes of a table: empty cells (bubbles that align its compute-only
orders in time) and the resource actions ``{stage}UNSHARD``, ``{stage}RESHARD`` and
``{stage}REDUCE_GRAD`` (:mod:`primuspipe.ir.resources`). Reading keeps them, with their column, as the
CSV's *extras* (:class:`TorchCsv`), so a torch CSV writes back cell for cell. A table written on its
own gets, in its communication (``compute_comms``) form, the resource actions torch's own lowering
would add: ``REDUCE_GRAD`` after each stage's last weight gradient -- in torch 2.13 that is where the
runtime divides gradients by the microbatch count, so without it torch's runtime with default settings
gives gradients m times too large -- and ``UNSHARD``/``RESHARD``, which FSDP-wrapped stages need.

The CSV has no room for the microbatch count or the algorithm's name (torch reads every row as a rank
and every cell as an action), so :func:`save_table` writes them to a sidecar ``<file>.meta.json`` that
:func:`load_table` reads. Without one, the microbatch count is the one most of the (stage, step)
columns run completely -- never a stray index -- so a microbatch missing on one stage, or one beyond
the count, is blamed on that stage.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from primuspipe.errors import OutputFileError, ScheduleShapeError, TableFormatError
from primuspipe import strict
from primuspipe.ir.dataflow import comm_node, transfer_of
from primuspipe.documents import check_envelope, envelope, output_file, write_atomically
from primuspipe.ir.kinds import NodeKind, all_kinds, on_kinds_changed, overlapped_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.io.primus_format import from_primus_table, looks_like_primus, to_primus_table
from primuspipe.ir.resources import Resource, resource_plan
from primuspipe.ir.limits import MAX_NODES
from primuspipe.ir.table import ScheduleTable

SIDECAR_SUFFIX = ".meta.json"
_SIDECAR_FORMAT, _SIDECAR_VERSION = "primuspipe.torch-csv-meta", 1
_RESOURCE_RE = re.compile(rf"([0-9]{{1,12}})({'|'.join(r.value for r in Resource)})([0-9]{{0,12}})", re.ASCII)
_OVERLAP_RE = re.compile(r"\((.*)\)OVERLAP_F_B")
_SIDECAR_KEYS = {"format", "version", "algorithm", "microbatches", "pp", "vpp"}
Action = tuple[int, str, int]
"""One parsed single action: ``(stage, torch type, microbatch)``."""


@functools.cache
def _torch_actions() -> dict[str, NodeKind]:
    """torch's action type -> our single-part kind (the kind table's ``torch_action``; cached per kind table)."""
    return {k.spec.torch_action: k for k in all_kinds() if k.spec.torch_action and not k.spec.parts}


@functools.cache
def _action_re() -> re.Pattern:
    names = sorted(_torch_actions(), key=len, reverse=True)  # SEND_F before F
    return re.compile(rf"([0-9]{{1,12}})({'|'.join(names)})([0-9]{{1,12}})", re.ASCII)


on_kinds_changed(_torch_actions.cache_clear)
on_kinds_changed(_action_re.cache_clear)


@dataclass(frozen=True)
class TorchCsv:
    """A torch CSV as read: its table plus the cells that are not table nodes."""

    table: ScheduleTable
    extras: tuple[tuple[tuple[int, str], ...], ...]
    """Per rank, ``(column, cell)`` of each bubble (``""``) and resource action (``"3UNSHARD"``)."""

    def text(self) -> str:
        """The CSV again, cell for cell."""
        return _write_rows(_cells(self.table, rank, self.extras[rank]) for rank in range(self.table.pp))


# -- writing ------------------------------------------------------------------------------------------
def to_torch_csv(table: ScheduleTable, compute_only: bool = False) -> str:
    """torch's CSV of ``table``: compute actions only, or (for a table with communication) compute,
    communication and the resource actions torch's own lowering adds (see the module docstring)."""
    if compute_only or not table.has_communication:
        rows = [[_torch_action(table, r, n) for n in row if n.kind.is_compute] for r, row in enumerate(table.ranks)]
        return _write_rows(rows)
    return _write_rows(_with_resources(table, rank) for rank in range(table.pp))


def _write_rows(rows) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerows(rows)
    return out.getvalue()


def _cells(table: ScheduleTable, rank: int, extras: tuple[tuple[int, str], ...]) -> list[str]:
    """The rank's node cells with ``extras`` put back at their columns."""
    nodes = iter(table.ranks[rank])
    at = dict(extras)
    return [at[col] if col in at else _torch_action(table, rank, next(nodes))
            for col in range(len(table.ranks[rank]) + len(extras))]


def _with_resources(table: ScheduleTable, rank: int) -> list[str]:
    """A rank's cells with the resource plan: unshards/reshards before a compute node, a reduction
    after the node and the sends that follow it (where torch's lowering puts it)."""
    plan = resource_plan(table, rank)
    cells: list[str] = []
    pending: list[str] = []
    for i, node in enumerate(table.ranks[rank]):
        if not node.kind.is_send:
            cells += pending
            pending = []
        cells += [str(a) for a in plan.before.get(i, ())]
        cells.append(_torch_action(table, rank, node))
        pending += [str(a) for a in plan.after.get(i, ())]
    return cells + pending + [str(a) for a in plan.at_end]


def _torch_action(table: ScheduleTable, rank: int, node: ScheduleNode) -> str:
    if node.kind.spec.torch_action is None:
        raise TableFormatError(f"torch's CSV has no action for {node.kind} (rank {rank}, {node}); write the table as "
                               "JSON, or export it before the offload pass")
    if node.pair is not None:
        inner = ";".join(f"{table.placement.stage(rank, chunk)}{kind.spec.torch_action}{mb}" for kind, mb, chunk in node.parts())
        return f"({inner}){node.kind.spec.torch_action}"
    return f"{table.placement.stage(rank, node.chunk)}{node.kind.spec.torch_action}{node.microbatch}"


# -- reading ------------------------------------------------------------------------------------------
def read_torch_csv(text: str, *, microbatches: int | None = None, algorithm: str = "torch-csv") -> TorchCsv:
    """Parse a torch.distributed.pipelining CSV (compute-only or with communication).

    ``microbatches`` is the step's microbatch count when known (a sidecar, the caller); otherwise it
    is inferred (see the module docstring)."""
    try:
        rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text))]
    except csv.Error as exc:
        raise TableFormatError(f"the CSV cannot be read: {exc}") from None
    while rows and not any(rows[-1]):
        rows.pop()
    while rows and not any(rows[0]):  # blank lines before the first rank's, as after the last: no rank
        rows.pop(0)
    if not rows:
        raise TableFormatError("the CSV holds no actions")
    if (cells := sum(map(len, rows))) > MAX_NODES:
        raise TableFormatError(f"the CSV has {cells:,} cells, more than the {MAX_NODES:,} nodes a table may have")
    parsed: list[list[tuple[Action, ...]]] = []
    cells: list[list[str]] = []
    extras: list[tuple[tuple[int, str], ...]] = []
    for r, row in enumerate(rows):
        extra = tuple((col, cell) for col, cell in enumerate(row) if not cell or _RESOURCE_RE.fullmatch(cell))
        skip = {col for col, _ in extra}
        cells.append([cell for col, cell in enumerate(row) if col not in skip])
        parsed.append([_parse_action(cell, r) for cell in cells[-1]])
        extras.append(extra)
    placement = _infer_placement(parsed)
    _check_resource_stages(placement, extras)
    m = microbatches if microbatches is not None else _infer_microbatches(placement, parsed)
    ranks = [[_to_node(placement, r, action, cell) for action, cell in zip(row, cells[r])]
             for r, row in enumerate(parsed)]
    return TorchCsv(ScheduleTable.build(placement, m, ranks, algorithm), tuple(extras))


def from_torch_csv(text: str, algorithm: str = "torch-csv", microbatches: int | None = None) -> ScheduleTable:
    """The table of a torch CSV (its bubbles and resource actions are dropped; see :func:`read_torch_csv`)."""
    return read_torch_csv(text, microbatches=microbatches, algorithm=algorithm).table


def _parse_action(cell: str, rank: int) -> tuple[Action, ...]:
    if m := _OVERLAP_RE.fullmatch(cell):
        return tuple(part for sub in m[1].split(";") for part in _parse_action(sub.strip(), rank))
    if m := _action_re().fullmatch(cell):
        return ((int(m[1]), m[2], int(m[3])),)
    raise TableFormatError(
        f"rank {rank}: cannot read action {cell!r}; supported are F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B "
        "(written {stage}{type}{microbatch}, e.g. 2F0), ({a};{b})OVERLAP_F_B, {stage}UNSHARD, {stage}RESHARD, "
        "{stage}REDUCE_GRAD and empty cells"
    )


def _compute_parts(parsed: list[list[tuple[Action, ...]]]):
    """``(rank, stage, torch type, microbatch)`` of every compute part."""
    computes = {name for name, kind in _torch_actions().items() if kind.is_compute}
    return [(r, s, t, mb) for r, row in enumerate(parsed) for action in row for s, t, mb in action if t in computes]


def _infer_placement(parsed: list[list[tuple[Action, ...]]]) -> Placement:
    stages: list[list[int]] = [[] for _ in parsed]
    for r, s, _, _ in _compute_parts(parsed):
        stages[r].append(s)
    for r, seen in enumerate(stages):
        if not seen:
            raise TableFormatError(f"rank {r} of the CSV runs no compute action, so its stages cannot be inferred")
    if sum(len(set(s)) for s in stages) != len({x for s in stages for x in s}):
        raise TableFormatError("a stage appears on more than one rank in the CSV; each stage must live on one rank")
    return Placement.infer(stages)


def _check_resource_stages(placement: Placement, extras: list[tuple[tuple[int, str], ...]]) -> None:
    for rank, extra in enumerate(extras):
        for _, cell in extra:
            if (m := _RESOURCE_RE.fullmatch(cell)) and (int(m[1]) >= placement.num_stages or placement.rank_of(int(m[1])) != rank):
                raise TableFormatError(f"rank {rank}: resource action {cell!r} names stage {m[1]}, which this rank "
                                       f"does not run (its stages: {list(placement.stages[rank])})")


def _infer_microbatches(placement: Placement, parsed: list[list[tuple[Action, ...]]]) -> int:
    """The microbatch count most (stage, step) columns run completely (0..k-1), the larger one on a
    tie; the largest index + 1 only when no column is complete."""
    kinds = _torch_actions()
    runs: dict[tuple[int, NodeKind], set[int]] = defaultdict(set)
    for _, stage, name, mb in _compute_parts(parsed):
        for step in kinds[name].completes:
            runs[(stage, step)].add(mb)
    votes = Counter(len(mbs) for mbs in runs.values() if mbs == set(range(len(mbs))))
    if not votes:
        return 1 + max(max(mbs) for mbs in runs.values())
    return max(votes, key=lambda k: (votes[k], k))


def _to_node(placement: Placement, rank: int, action: tuple[Action, ...], cell: str) -> ScheduleNode:
    def local_chunk(stage: int) -> int:
        if stage >= placement.num_stages:
            raise TableFormatError(f"rank {rank}: action {cell!r} names stage {stage}, but the CSV has "
                                   f"{placement.num_stages} stages")
        where, chunk = placement.locate(stage)
        if where != rank:
            raise TableFormatError(f"rank {rank}: action {cell!r} names stage {stage}, which runs on rank {where}")
        return chunk

    kinds = _torch_actions()
    if len(action) == 2:
        (fs, fk, fmb), (bs, bk, bmb) = action
        try:
            kind = overlapped_kind((kinds[fk], kinds[bk]))
        except (KeyError, TableFormatError):
            raise TableFormatError(f"rank {rank}: {cell!r} must overlap an F (first) with an I or a B action") from None
        return ScheduleNode(kind, fmb, local_chunk(fs), pair=(bmb, local_chunk(bs)))
    if len(action) != 1:
        raise TableFormatError(f"rank {rank}: {cell!r} must overlap exactly two actions, an F and an I or a B")
    (stage, name, mb), = action
    kind = kinds[name]
    if kind.is_compute:
        return ScheduleNode(kind, mb, local_chunk(stage))
    probe = ScheduleNode(kind, mb, local_chunk(stage), peer=0)
    transfer = transfer_of(placement, rank, probe)
    if not 0 <= transfer.src_stage < placement.num_stages or not 0 <= transfer.dst_stage < placement.num_stages:
        raise TableFormatError(f"rank {rank}: {cell!r} moves data past the first or last stage")
    return comm_node(placement, transfer, send=kind.is_send)


# -- files --------------------------------------------------------------------------------------------
def sidecar_path(path: str | Path) -> Path:
    """Where the microbatch count and algorithm of ``path`` (a CSV) are kept."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def load_table(path: str | Path, placement: str | None = None) -> ScheduleTable:
    """Read a table from ``.json`` (ours), ``.csv`` (torch.distributed.pipelining actions, with its
    sidecar when there is one) or Primus's printed form (any other text holding ``Rank <r>:`` lines;
    ``placement`` names its layout where the text cannot, :mod:`primuspipe.io.primus_format`); every
    error names the file."""
    path = strict.file_path(path, "schedule file", error=TableFormatError)
    text = strict.read_text(path, "schedule file", error=TableFormatError,
                            missing="'primuspipe export ALGORITHM --pp P -m M -o FILE' writes one")
    primus = path.suffix.lower() != ".csv" and not text.lstrip().startswith("{") and looks_like_primus(text)
    if placement is not None and not primus:
        raise TableFormatError(f"{path} records its own stage layout; a placement is given only for Primus's printed "
                               "table form (drop --placement)")
    if primus:
        try:
            return from_primus_table(text, placement, algorithm=None)
        except (TableFormatError, ScheduleShapeError) as exc:
            raise TableFormatError(f"{path}: {exc}") from None
    if path.suffix.lower() != ".csv":
        return ScheduleTable.from_json(text, str(path))
    meta = _read_sidecar(path)
    try:
        table = from_torch_csv(text, algorithm=meta.get("algorithm", path.stem), microbatches=meta.get("microbatches"))
    except (TableFormatError, ScheduleShapeError) as exc:
        raise TableFormatError(f"{path}: {exc}") from None
    if (table.pp, table.vpp) != (meta.get("pp", table.pp), meta.get("vpp", table.vpp)):
        raise TableFormatError(f"{sidecar_path(path)} describes pp={meta.get('pp')}, vpp={meta.get('vpp')} but {path} has "
                               f"pp={table.pp}, vpp={table.vpp}; the sidecar belongs to another schedule (delete it "
                               "or write both again)")
    return table


TABLE_KINDS = {"json": "JSON", "csv": "CSV", "primus": "text"}
"""What a file of each table format holds, as :func:`~primuspipe.documents.output_file` names kinds: :func:`load_table`
reads a ``.csv`` as torch's CSV and anything else as JSON or Primus's text, so a format must be written under a
name it reads back as that format."""


def table_format(path: Path, fmt: str | None) -> str:
    """``fmt``, or the format :func:`load_table` reads a file named ``path`` as (``csv`` for ``.csv``, else
    ``json``)."""
    return fmt or ("csv" if path.suffix.lower() == ".csv" else "json")


def table_kind(path: Path, fmt: str | None) -> str | None:
    """What a table file of ``fmt`` at ``path`` holds (:data:`TABLE_KINDS`; None for a format :func:`dump_table`
    refuses)."""
    fmt = table_format(path, fmt)
    return TABLE_KINDS.get(fmt) if isinstance(fmt, str) else None


def save_table(table: ScheduleTable, path: str | Path, fmt: str | None = None, compute_only: bool = False) -> list[Path]:
    """Write ``table`` to ``path`` as ``fmt`` (``"json"``, ``"csv"`` or ``"primus"``; default: by the suffix), a CSV
    with its sidecar, its folder created as :meth:`Timeline.save` does; returns the files written. A format named
    as another (a CSV table at ``t.json``: :func:`load_table` would read it as JSON) is refused before writing."""
    path = strict.file_path(path, "table file", error=OutputFileError)
    files = table_files(table, output_file(path, "table file", writes=table_kind(path, fmt)), fmt, compute_only)
    for where, text in files.items():
        write_atomically(where, text)
    return list(files)


def table_files(table: ScheduleTable, path: str | Path, fmt: str | None = None,
                compute_only: bool = False) -> dict[Path, str]:
    """What :func:`save_table` writes: path -> text (a CSV's sidecar beside it)."""
    path = strict.file_path(path, "table file", error=OutputFileError)
    fmt = table_format(path, fmt)
    files = {path: dump_table(table, fmt, compute_only)}
    if fmt == "csv":
        meta = {**envelope(_SIDECAR_FORMAT, _SIDECAR_VERSION), "algorithm": table.algorithm,
                "microbatches": table.microbatches, "pp": table.pp, "vpp": table.vpp}
        files[sidecar_path(path)] = json.dumps(meta, indent=1)
    return files


def _read_sidecar(path: Path) -> dict:
    side = sidecar_path(path)
    if not side.exists():
        return {}
    data = strict.load_json(strict.read_text(side, "torch CSV sidecar", error=TableFormatError), str(side),
                            error=TableFormatError)
    check_envelope(data, _SIDECAR_FORMAT, _SIDECAR_VERSION, "torch CSV sidecar", str(side))
    data = strict.keys(data, str(side), _SIDECAR_KEYS, required={"microbatches"}, error=TableFormatError)
    strict.count(data["microbatches"], f"{side}: microbatches", minimum=1, error=TableFormatError)
    for key in ("pp", "vpp"):
        if key in data:
            strict.count(data[key], f"{side}: {key}", minimum=1, error=TableFormatError)
    if "algorithm" in data:
        strict.text(data["algorithm"], f"{side}: algorithm", error=TableFormatError)
    return data


def dump_table(table: ScheduleTable, fmt: str, compute_only: bool = False) -> str:
    """Text of ``table`` as ``"json"``, ``"csv"`` or ``"primus"`` (Primus's printed table form)."""
    if fmt == "json":
        return (table.compute_only() if compute_only else table).to_json()
    if fmt == "csv":
        return to_torch_csv(table, compute_only)
    if fmt == "primus":
        return to_primus_table(table, compute_only) + "\n"
    raise TableFormatError(f"unknown format {fmt!r}; use 'json', 'csv' or 'primus'")
