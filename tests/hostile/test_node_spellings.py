"""Round twelve: the first node of a schedule -- ``F0.0`` -- spelt every odd way in each text form a table is read from
(the JSON table's node text, Primus's printed ``(F|0|0)`` and its ``Rank 0:`` line, the torch CSV's ``0F0``): case,
blanks inside and around, leading zeros, signs, exponents, other digits (Arabic-Indic, full-width, superscript),
invisible and bidirectional characters, a peer on a compute node, a pair of three, brackets half closed. A spelling
that still says ``F0.0`` (blanks around it, leading zeros: :data:`SAME`) validates; any other is refused in one line
naming the file -- never read as another node (``validate`` would then find ``F0.0`` missing, the oracle here), and
never as another format. The rank line's spellings name the line.

Defect this family found: a Primus table whose ``Rank 0:`` line was mistyped (``rank 0:``, ``Rank ٠:``, a first rank
other than 0) was read as JSON and refused as "not valid JSON: Expecting value at line 1 column 1"."""

import json
import re

import pytest

from hostile_support import accepted, refused, run_cli
from primuspipe.algorithms.build import build_schedule
from primuspipe.io.formats import dump_table, save_table

TABLE = build_schedule("zb-h1", pp=2, microbatches=3)
ODD = ["\u0660", "\uff10", "\u2070", "\u200b", "\u202e", "-", "+", "1e0", " ", "_", "\x00", "#", ";"]
"""Characters and texts no node spelling holds (digits of other scripts, invisible and bidi characters, ...)."""
FORMS = {
    "json": ("t.json", "F0.0", r"\s*F0+\.0+\s*"),
    "primus": ("t.txt", "(F|0|0)", r"\s*\(F\|0+\|0+\)\s*"),
    "csv": ("t.csv", "0F0", r"\s*\"?0+F0+\"?\s*"),
}
"""Form -> (file name, the first node's text, the spellings that still say it)."""


def _spellings(node: str) -> list[str]:
    """The node with each odd character put at its start, its middle and its end, and its other mistakes."""
    middle = len(node) // 2
    out = {node, node.lower(), f" {node}", f"{node} ", node.replace("0", "00", 1), node + node, node[:-1], node[1:],
           f"[{node}]", f"[{node}", f"{node}]", f"({node})", node.replace("0", "-0", 1), node.replace("F", "Ｆ")}
    out |= {s for odd in ODD for s in (odd + node, node[:middle] + odd + node[middle:], node + odd)}
    return sorted(out)


CASES = [(form, text) for form, (_, node, _) in FORMS.items() for text in _spellings(node)]


def _write(tmp_path, form: str, text: str):
    """The table in ``form`` (a CSV with its sidecar) with its first node spelt ``text``."""
    name, node, _ = FORMS[form]
    path = tmp_path / name
    save_table(TABLE, path, "csv" if form == "csv" else "json")
    if form == "json":
        data = json.loads(path.read_text())
        data["ranks"][0][data["ranks"][0].index(node)] = text
        path.write_text(json.dumps(data))
    else:
        source = path.read_text() if form == "csv" else dump_table(TABLE, "primus", compute_only=True)
        path.write_text(source.replace(node, text, 1))
    return path


@pytest.mark.parametrize("form, text", CASES, ids=[f"{f}-{t!r}" for f, t in CASES])
def test_node_spelling(tmp_path, form, text):
    path = _write(tmp_path, form, text)
    outcome = run_cli(["validate", path])
    case = f"{form} first node spelt {text!r}"
    if re.fullmatch(FORMS[form][2], text):
        accepted(outcome, case=case)
    else:
        refused(outcome, path.name, case=case)


RANK_LINES = {"Rank 0:": True, "Rank 0 :": True, "Rank  0:": True, "Rank 00:": True, "  Rank 0:": True,
              "rank 0:": False, "RANK 0:": False, "Rank0:": False, "Rank O:": False, "Rank \u0660:": False,
              "Rank -0:": False, "Rank 2:": False, "[Rank 0]:": False, "Rank 0::": False}


@pytest.mark.parametrize("line", sorted(RANK_LINES))
def test_rank_line_spelling(tmp_path, line):
    path = tmp_path / "t.txt"
    path.write_text(dump_table(TABLE, "primus", compute_only=True).replace("Rank 0:", line, 1))
    outcome = run_cli(["validate", path])
    case = f"primus rank line spelt {line!r}"
    if RANK_LINES[line]:
        accepted(outcome, case=case)
    else:
        refused(outcome, path.name, case=case)
        assert "JSON" not in outcome.message, f"{case}: read as another format: {outcome.message}"
