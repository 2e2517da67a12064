"""Primus's algorithm names (aliases) and its printed schedule-table form, both ways."""

import re

import pytest

from primuspipe.algorithms import get_algorithm, list_algorithms, list_aliases, register
from primuspipe.algorithms.build import build_schedule
from primuspipe.cli import main
from primuspipe.errors import ConfigError, DuplicateAlgorithmError, ScheduleShapeError, TableFormatError
from primuspipe.io.formats import load_table
from primuspipe.io.primus_format import from_primus_table, to_primus_table

PRIMUS_NAMES = ("1f1b", "1f1b-interleaved", "zero-bubble", "zero-bubble-heuristic", "zbv-formatted", "zbv-greedy",
                "v-half", "v-min")
"""Primus's pp_algorithm values (its config documents all but zbv-greedy, the class behind v-half/v-min)."""


@pytest.mark.parametrize("name", PRIMUS_NAMES)
def test_every_primus_name_builds(name):
    info = get_algorithm(name)
    table = build_schedule(name, pp=4, microbatches=8)
    assert table == build_schedule(info.alias_of or name, 4, 8, info.resolve_vpp(None), **info.preset)
    assert table.vpp == (1 if name in ("1f1b", "zero-bubble", "zero-bubble-heuristic") else 2)


def test_aliases_fix_what_primus_fixes():
    with pytest.raises(ScheduleShapeError, match="zero-bubble-heuristic needs vpp = 1"):
        build_schedule("zero-bubble-heuristic", pp=2, microbatches=4, vpp=2)
    with pytest.raises(ConfigError, match="has no option.*placement"):
        build_schedule("zero-bubble-heuristic", pp=2, microbatches=4, placement="v")
    assert get_algorithm("zero-bubble-heuristic").placement == "interleaved"
    assert not {a.name for a in list_aliases()} & {i.name for i in list_algorithms()}
    with pytest.raises(DuplicateAlgorithmError, match="Primus's name for 'zbv'"):
        register("zbv-formatted")(lambda request: None)


def test_list_shows_the_aliases(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for alias in list_aliases():
        assert re.search(rf"{re.escape(alias.name)}\s+│\s+{re.escape(alias.target)}", out), alias.name


def _every_table():
    for info in list_algorithms():
        for pp, m in ((2, 4), (4, 8), (3, 6)):
            try:
                yield build_schedule(info.name, pp, m)
            except ScheduleShapeError:
                continue


def test_every_table_round_trips_through_primus_form():
    tables = list(_every_table())
    assert len(tables) >= 25 and {t.placement.name for t in tables} == {"interleaved", "v"}
    for table in tables:
        text = to_primus_table(table)
        assert from_primus_table(text) == table, table.algorithm
        pasted = "\n".join(line for line in text.splitlines() if not line.startswith("#"))  # as Primus prints it
        assert from_primus_table(pasted, algorithm=table.algorithm) == table, table.algorithm


def test_primus_log_with_colours_and_self_hand_offs():
    """What Primus prints at the V's turn: colour codes around overlapped groups, a send and a receive of rank
    1 to itself (we hand over locally), a prefix before 'Rank'."""
    table = build_schedule("dualpipe-v", pp=2, microbatches=4)
    lines = to_primus_table(table).splitlines()[1:]
    row = lines[1].split(": ", 1)[1]
    assert "(SF|0|0)" not in row and "(RF|0|1)" not in row
    row = row.replace("(F|0|0),", "(F|0|0),(SF|0|0),", 1).replace("(F|0|1)", "(RF|0|1),(F|0|1)", 1)
    lines[1] = "\x1b[33m]Rank 1: " + row
    lines = [line.replace("[", "\x1b[32m[").replace("]", "]\x1b[33m") if "Rank" in line[:12] else line
             for line in lines]
    assert from_primus_table("[rank0]: log noise\n" + "\n".join(lines), algorithm="dualpipe-v") == table


@pytest.mark.parametrize("text,match", [
    ("Rank 0: [(F|0|0),[(B|0|0)]]\nRank 1: (F|0|0)", "cannot nest"),
    ("Rank 0: (F|0|0),(X|0|0)\nRank 1: (F|0|0)", r"\(X\|0\|0\) is not a node"),
    ("Rank 0: (F|0|0)\nRank 2: (F|0|0)", "ranks must be 0..1"),
    ("Rank 0: (F|0|0),(F|0|1)\nRank 1: (F|0|0),(F|0|1)", "could be a V or interleaved; name the placement"),
    ("Rank 0: [(B|0|0),(F|1|0)]\nRank 1: (F|0|0)", "an F and then a B or BW"),
    ("nothing here", "no 'Rank <r>: "),
])
def test_bad_primus_tables_say_what_is_wrong(text, match):
    with pytest.raises(TableFormatError, match=match):
        from_primus_table(text)


def test_export_then_validate_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "zbv.txt"
    assert main(["export", "zbv-formatted", "--pp", "4", "-m", "8", "--format", "primus", "-o", str(path)]) == 0
    assert load_table(path) == build_schedule("zbv", 4, 8)
    assert path.read_text().splitlines()[1].startswith("Rank 0: (F|0|0),(SF|0|0),")
    assert main(["validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out
    compute_only = tmp_path / "compute.txt"
    compute_only.write_text("\n".join(to_primus_table(build_schedule("zbv", 2, 4), compute_only=True)
                                      .splitlines()[1:]))
    assert main(["validate", str(compute_only)]) == 1
    assert "name the placement" in capsys.readouterr().out
    assert main(["validate", str(compute_only), "--placement", "v"]) == 0
