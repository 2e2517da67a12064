"""Reading and writing tables: JSON (lossless, ours) and torch.distributed.pipelining's CSV actions.

The CSV format has one row per rank and one action per cell, written as ``{stage}{type}{microbatch}``
(``2F0``, ``1I3``, ``0SEND_F1``; ``B`` is torch's full backward, ``I`` its input-grad backward) and
``({a};{b})OVERLAP_F_B`` for an overlapped pair. Torch names global stages and leaves peers implicit,
so reading a CSV infers the placement from which rank runs which stage. Torch's communication-lowered
CSVs also carry FSDP resource actions (UNSHARD, RESHARD, REDUCE_GRAD); they move no pipeline data, so
reading skips them and writing never emits them.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from primuspipe.ir.dataflow import comm_node, transfer_of
from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind, all_kinds, overlapped_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable



def _torch_actions() -> dict[str, NodeKind]:
    """torch's action type -> our single-part kind (the kind table's ``torch_action``)."""
    return {k.spec.torch_action: k for k in all_kinds() if k.spec.torch_action and not k.spec.parts}


def _action_re() -> re.Pattern:
    names = sorted(_torch_actions(), key=len, reverse=True)  # SEND_F before F
    return re.compile(rf"^(\d+)({'|'.join(names)})(\d+)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_FSDP_RE = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*$")


def to_torch_csv(table: ScheduleTable, compute_only: bool = False) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank, row in enumerate(table.ranks):
        writer.writerow([_torch_action(table, rank, n) for n in row if n.kind.is_compute or not compute_only])
    return out.getvalue()


def _torch_action(table: ScheduleTable, rank: int, node: ScheduleNode) -> str:
    stage = table.placement.stage(rank, node.chunk)
    if node.pair is not None:
        inner = ";".join(f"{table.placement.stage(rank, chunk)}{kind.spec.torch_action}{mb}" for kind, mb, chunk in node.parts())
        return f"({inner}){node.kind.spec.torch_action}"
    return f"{stage}{node.kind.spec.torch_action}{node.microbatch}"


def from_torch_csv(text: str, algorithm: str = "torch-csv") -> ScheduleTable:
    """Parse a torch.distributed.pipelining CSV (compute-only or with communication)."""
    rows = [[c for cell in row if (c := cell.strip()) and not _FSDP_RE.match(c)] for row in csv.reader(io.StringIO(text))]
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise TableFormatError("the CSV holds no actions")
    parsed = [[_parse_action(cell, r) for cell in row] for r, row in enumerate(rows)]
    computes = {name for name, kind in _torch_actions().items() if kind.is_compute}
    stages = [[s for action in row for s, kind, _ in action if kind in computes] for row in parsed]
    for r, seen in enumerate(stages):
        if not seen:
            raise TableFormatError(f"rank {r} of the CSV runs no compute action, so its stages cannot be inferred")
    placement = Placement.infer(stages)
    if sum(len(set(s)) for s in stages) != len({x for s in stages for x in s}):
        raise TableFormatError("a stage appears on more than one rank in the CSV; each stage must live on one rank")
    microbatches = 1 + max(mb for row in parsed for action in row for _, _, mb in action)
    ranks = [[_to_node(placement, r, action, cell) for action, cell in zip(row, rows[r])] for r, row in enumerate(parsed)]
    return ScheduleTable.build(placement, microbatches, ranks, algorithm)


def _parse_action(cell: str, rank: int) -> tuple[tuple[int, str, int], ...]:
    if m := _OVERLAP_RE.match(cell):
        return tuple(part for sub in m[1].split(";") for part in _parse_action(sub.strip(), rank))
    if m := _action_re().match(cell):
        return ((int(m[1]), m[2], int(m[3])),)
    raise TableFormatError(
        f"rank {rank}: cannot read action {cell!r}; supported are F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B "
        "and OVERLAP_F_B, written as {stage}{type}{microbatch}, e.g. 2F0"
    )


def _to_node(placement: Placement, rank: int, action: tuple[tuple[int, str, int], ...], cell: str) -> ScheduleNode:
    def local_chunk(stage: int) -> int:
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
            raise TableFormatError(f"rank {rank}: {cell!r} must overlap one F and one I (input-grad) action") from None
        return ScheduleNode(kind, fmb, local_chunk(fs), pair=(bmb, local_chunk(bs)))
    (stage, name, mb), = action
    kind = kinds[name]
    if kind.is_compute:
        return ScheduleNode(kind, mb, local_chunk(stage))
    probe = ScheduleNode(kind, mb, local_chunk(stage), peer=0)
    return comm_node(placement, transfer_of(placement, rank, probe), send=kind.is_send)


def load_table(path: str | Path) -> ScheduleTable:
    """Read a table from ``.json`` (ours) or ``.csv`` (torch.distributed.pipelining actions)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TableFormatError(f"cannot read schedule file {path}: {exc.strerror}") from exc
    if path.suffix.lower() == ".csv":
        return from_torch_csv(text, algorithm=path.stem)
    return ScheduleTable.from_json(text)


def dump_table(table: ScheduleTable, fmt: str, compute_only: bool = False) -> str:
    """Text of ``table`` as ``"json"`` or ``"csv"``."""
    if fmt == "json":
        return (table.compute_only() if compute_only else table).to_json()
    if fmt == "csv":
        return to_torch_csv(table, compute_only)
    raise TableFormatError(f"unknown format {fmt!r}; use 'json' or 'csv'")
