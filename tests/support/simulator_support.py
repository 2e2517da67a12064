"""Helpers shared by the simulator and pp_vis tests: tables written as text, and the rows of
``primuspipe simulate --json``."""

import json

from primuspipe.cli import main
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable


def text_table(pp: int, rows: list[str], m: int, vpp: int = 1) -> ScheduleTable:
    """An interleaved-placement table from one line of node texts per rank (``"F0.0 BW0.0"``)."""
    ranks = [[ScheduleNode.parse(t) for t in r.split()] for r in rows]
    return ScheduleTable.build(Placement.interleaved(pp, vpp), m, ranks)


def simulate_rows(capsys, *argv: str) -> list[dict]:
    """The result rows of ``primuspipe simulate ARGV --json``, which must exit 0."""
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["results"]
