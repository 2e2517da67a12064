"""Primus's schedule-table form: the per-rank node lists its ``debug_scheduler_table`` prints.

Primus prints one line per rank, ``Rank 0: (F|0|0),(SF|0|0),(RB|0|0),(B|0|0),(SB|0|0),(W|0|0),...``:
each node is ``(TYPE|microbatch|chunk)``, the chunk being the rank's local one, as ours. Its types map to
our kinds one for one (``F``, ``B``, ``W``, ``BW``; ``SF``/``SB``/``RF``/``RB`` are SEND_F, SEND_B,
RECV_F, RECV_B); an F and a B run as one overlapped pair are printed inside ``[...]`` (Primus colours the
brackets; the colour codes are ignored), which is our ``FB`` node (``FBW`` with a ``BW``).

The form names no peers, no placement and no microbatch count. A peer follows from the placement (the
rank holding the neighbouring stage, exactly as torch's CSV actions are read); Primus also writes a
send and a receive to the rank itself at the V's turn, where we hand the activation over locally, so
those are dropped. :func:`to_primus_table` writes a first comment line with what the form lacks
(``# primuspipe: algorithm=zbv pp=4 vpp=2 microbatches=8 placement=v``); without one -- text pasted
from a Primus log -- vpp = 1 or vpp > 2 is interleaved, and at vpp = 2 the V is told from the
interleaved layout by rank 0's sends (in the V, rank 0's chunk 1 is the last stage and sends no
activation); a compute-only text at vpp = 2 needs the placement named.

>>> from primuspipe.ir.node import BW, F
>>> from primuspipe.ir.placement import Placement
>>> table = ScheduleTable.build(Placement.interleaved(2, 1), 1, [[F(0), BW(0)], [F(0), BW(0)]], "gpipe")
>>> print(to_primus_table(table))
# primuspipe: algorithm=gpipe pp=2 vpp=1 microbatches=1 placement=interleaved
Rank 0: (F|0|0),(BW|0|0)
Rank 1: (F|0|0),(BW|0|0)
>>> from_primus_table(to_primus_table(table)) == table
True
"""

from __future__ import annotations

import functools
import re
from itertools import groupby

from primuspipe.errors import TableFormatError
from primuspipe import strict
from primuspipe.ir.dataflow import comm_node, transfer_of
from primuspipe.ir.kinds import NodeKind, all_kinds, on_kinds_changed, overlapped_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANK_LINE = re.compile(r"Rank\s+([0-9]+)\s*:(.*)$", re.ASCII)
_TOKEN = re.compile(r"(\[)?\((\w+)\|([0-9]{1,9})\|([0-9]{1,9})\)(\])?", re.ASCII)
_NODE_LIKE = re.compile(r"\([^()|]*\|[^()|]*\|[^()]*\)")
_LOOKS_LIKE_NODE = re.compile(rf"{_NODE_LIKE.pattern}|Rank\s*\S*\s*:")
_BETWEEN = re.compile(r"[\s,]*")
_HEADER = re.compile(r"^#\s*primuspipe:(.*)$")
_HEADER_KEYS = {"algorithm", "pp", "vpp", "microbatches", "placement"}


@functools.cache
def _primus_kinds() -> dict[str, NodeKind]:
    """Primus's node type -> our single-part kind (the kind table's ``primus_type``; cached per kind table)."""
    return {k.spec.primus_type: k for k in all_kinds() if k.spec.primus_type and not k.spec.parts}


on_kinds_changed(_primus_kinds.cache_clear)


def to_primus_table(table: ScheduleTable, compute_only: bool = False) -> str:
    """``table`` in Primus's printed form, after a comment line with its algorithm, shape and placement."""
    if compute_only:
        table = table.compute_only()
    head = (f"# primuspipe: algorithm={table.algorithm} pp={table.pp} vpp={table.vpp} "
            f"microbatches={table.microbatches} placement={table.placement.name}")
    rows = [f"Rank {rank}: " + ",".join(_write(rank, node) for node in row) for rank, row in enumerate(table.ranks)]
    return "\n".join([head, *rows])


def _write(rank: int, node: ScheduleNode) -> str:
    parts = node.parts() or ((node.kind, node.microbatch, node.chunk),)
    text = ",".join(f"({_primus_type(rank, node, kind)}|{mb}|{chunk})" for kind, mb, chunk in parts)
    return f"[{text}]" if node.pair is not None else text


def _primus_type(rank: int, node: ScheduleNode, kind: NodeKind) -> str:
    if kind.spec.primus_type is None:
        raise TableFormatError(f"rank {rank}: {node} has no Primus node type (Primus has "
                               f"{', '.join(_primus_kinds())})")
    return kind.spec.primus_type


def looks_like_primus(text: str) -> bool:
    """Whether ``text`` is meant as Primus's printed table: a ``# primuspipe:`` header, or a line holding a rank line
    or nodes of its form, mistyped ones too (``rank 0:``, a first rank other than 0), so that its reader names the line
    -- only ``Rank 0:`` was looked for, and a table whose first rank line was mistyped was read as JSON ("not valid
    JSON: Expecting value at line 1 column 1")."""
    return any(_HEADER.match(line.strip()) or _LOOKS_LIKE_NODE.search(line) for line in text.splitlines())


def from_primus_table(text: str, placement: str | None = None, algorithm: str | None = None) -> ScheduleTable:
    """The table of Primus's printed form (or :func:`to_primus_table`'s). ``placement`` (``"interleaved"`` or
    ``"v"``) names the layout of a text whose header does not (one that contradicts the header is refused); without
    either it is inferred as the module doc says."""
    header: dict[str, str] = {}
    rows: dict[int, list[Token]] = {}
    for line_no, raw in enumerate(text.splitlines(), 1):
        line = _ANSI.sub("", raw)
        if (m := _HEADER.match(line.strip())) is not None:
            header = _header(m[1], line_no)
            continue
        if (m := _RANK_LINE.search(line)) is None or _NODE_LIKE.search(line, 0, m.start()):
            if _LOOKS_LIKE_NODE.search(line):  # nodes outside a 'Rank <r>:' line: a rank line mistyped
                raise TableFormatError(f"line {line_no}: {strict.show(line.strip())} holds nodes but is no "
                                       "'Rank <r>: (F|0|0),...' line (rank numbers in ASCII digits)")
            continue
        rank = strict.count(m[1], f"line {line_no}: the rank number", error=TableFormatError, text=True)
        if rank in rows:
            raise TableFormatError(f"line {line_no}: rank {rank} appears twice")
        rows[rank] = _tokens(m[2], line_no)
    if not rows:
        raise TableFormatError("no 'Rank <r>: (F|0|0),...' lines found; expected Primus's printed schedule table")
    pp = len(rows)
    if sorted(rows) != list(range(pp)):
        raise TableFormatError(f"the ranks must be 0..{pp - 1}, got {sorted(rows)}")
    if "pp" in header and strict.count(header["pp"], "header pp", error=TableFormatError, minimum=1, text=True) != pp:
        raise TableFormatError(f"the header says pp={header['pp']} but the text has {pp} 'Rank <r>:' lines; a line is "
                               "missing or the header belongs to another table")
    steps = (NodeKind.F, NodeKind.B, NodeKind.W, NodeKind.BW)
    compute = [t for row in rows.values() for t in row if _primus_kinds().get(t[0]) in steps]
    vpp = strict.count(header.get("vpp", 1 + max((t[2] for t in compute), default=0)), "header vpp",
                       error=TableFormatError, minimum=1, text=True)
    microbatches = strict.count(header.get("microbatches", 1 + max((t[1] for t in compute), default=0)),
                                "header microbatches", error=TableFormatError, minimum=1, text=True)
    if placement is not None and header.get("placement", placement) != placement:
        raise TableFormatError(f"the header says placement={header['placement']}, but placement {placement!r} is asked "
                               "for (--placement); drop it: it names the layout of a table that does not say")
    layout = placement or header.get("placement")
    where = _named(layout, pp, vpp, "--placement" if placement else "the header") if layout else \
        _infer_layout(rows, pp, vpp)
    ranks = [_nodes(where, rank, rows[rank]) for rank in range(pp)]
    return ScheduleTable.build(where, microbatches, ranks, algorithm or header.get("algorithm", "primus"))


def _named(layout: str, pp: int, vpp: int, source: str) -> Placement:
    """The layout named by ``source`` (the header or ``--placement``), the source named where it cannot be."""
    try:
        return Placement.named(layout, pp, vpp)
    except TableFormatError as exc:
        raise TableFormatError(f"placement={strict.printable(layout)} ({source}): {exc}") from None


Token = tuple[str, int, int, "int | None"]
"""``(Primus type, microbatch, chunk, overlapped group number or None)`` of one printed node."""


def _header(text: str, line_no: int) -> dict[str, str]:
    """The ``key=value`` items of the ``# primuspipe:`` comment line; anything else in it is refused."""
    header: dict[str, str] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or key not in _HEADER_KEYS or not value or "=" in value:
            raise TableFormatError(f"line {line_no}: the header item {item!r} is not one of "
                                   f"{', '.join(f'{k}=...' for k in sorted(_HEADER_KEYS))}")
        if key in header:
            raise TableFormatError(f"line {line_no}: the header gives {key} twice")
        header[key] = value
    return header


def _tokens(text: str, line_no: int) -> list[Token]:
    """The nodes of one rank line, each with the number of the ``[...]`` group it is in (None outside).
    Only nodes, commas and spaces may stand in it: anything else (a token mistyped, a stray word) is
    refused where it stands rather than dropped."""
    out: list[Token] = []
    group, groups = None, 0
    at = 0
    for m in _TOKEN.finditer(text):
        if not _BETWEEN.fullmatch(text, at, m.start()):
            raise TableFormatError(f"line {line_no}: cannot read {text[at:m.start()].strip(' ,')!r}; a rank line holds "
                                   "(TYPE|microbatch|chunk) nodes separated by commas, overlapped pairs in [...]")
        at = m.end()
        if m[1]:
            if group is not None:
                raise TableFormatError(f"line {line_no}: overlapped groups '[...]' cannot nest")
            group, groups = groups, groups + 1
        out.append((m[2], int(m[3]), int(m[4]), group))
        if m[5]:
            if group is None:
                raise TableFormatError(f"line {line_no}: ']' without '['")
            group = None
    if group is not None:
        raise TableFormatError(f"line {line_no}: '[' without ']'")
    if not _BETWEEN.fullmatch(text, at):
        raise TableFormatError(f"line {line_no}: cannot read {text[at:].strip(' ,')!r}; a rank line holds "
                               "(TYPE|microbatch|chunk) nodes separated by commas, overlapped pairs in [...]")
    return out


def _infer_layout(rows: dict[int, list[Token]], pp: int, vpp: int) -> Placement:
    kinds = _primus_kinds()
    if vpp == 2 and all(t[0] not in kinds or kinds[t[0]].is_compute for row in rows.values() for t in row):
        raise TableFormatError("a compute-only table with 2 chunks per rank could be a V or interleaved; name the "
                               "placement ('v' or 'interleaved', CLI: --placement)")
    return Placement.shown_by(pp, vpp, (t[2] for t in rows[0] if kinds.get(t[0]) is NodeKind.SEND_F))


def _nodes(placement: Placement, rank: int, tokens: list[Token]) -> list[ScheduleNode]:
    nodes: list[ScheduleNode] = []
    for group, members in groupby(tokens, key=lambda t: t[3]):
        if group is not None:
            nodes.extend(_group_nodes(placement, rank, list(members)))
        else:
            nodes.extend(n for n in (_node(placement, rank, t) for t in members) if n is not None)
    return nodes


def _group_nodes(placement: Placement, rank: int, group: list[Token]) -> list[ScheduleNode]:
    """An overlapped group: its receives, the F + B (or BW) pair as one node, then its sends."""
    singles = [n for n in (_node(placement, rank, t) for t in group) if n is not None]
    compute = [n for n in singles if n.kind.is_compute]
    if len(compute) != 2 or compute[0].kind is not NodeKind.F:
        raise TableFormatError(f"rank {rank}: an overlapped group must hold an F and then a B or BW, got "
                               f"{', '.join(map(str, compute)) or 'no compute node'}")
    first, second = compute
    pair = ScheduleNode(overlapped_kind((first.kind, second.kind)), first.microbatch, first.chunk,
                        pair=(second.microbatch, second.chunk))
    receives = [n for n in singles if not n.kind.is_compute and not n.kind.is_send]
    sends = [n for n in singles if n.kind.is_send]
    return [*receives, pair, *sends]


def _node(placement: Placement, rank: int, token: Token) -> ScheduleNode | None:
    """The node of one ``(TYPE|mb|chunk)``; None for Primus's send or receive to the rank itself."""
    name, mb, chunk, _ = token
    kind = _primus_kinds().get(name)
    if kind is None:
        raise TableFormatError(f"rank {rank}: ({name}|{mb}|{chunk}) is not a node primuspipe runs; known types: "
                               f"{', '.join(_primus_kinds())}")
    if chunk >= placement.vpp:
        raise TableFormatError(f"rank {rank}: ({name}|{mb}|{chunk}) names chunk {chunk}, but ranks hold {placement.vpp}")
    if kind.is_compute:
        return ScheduleNode(kind, mb, chunk)
    transfer = transfer_of(placement, rank, ScheduleNode(kind, mb, chunk, peer=0))
    if not all(0 <= s < placement.num_stages for s in (transfer.src_stage, transfer.dst_stage)):
        raise TableFormatError(f"rank {rank}: ({name}|{mb}|{chunk}) moves data past the first or last stage "
                               f"(placement {placement.name})")
    node = comm_node(placement, transfer, send=kind.is_send)
    return None if node.peer == rank else node
