"""Round fourteen: ``--placement`` (``vis``, ``calibrate``, ``validate``) names the stage layout of an input that does
not say it -- an unregistered algorithm's timeline, a Primus text without its header. Generated over every input kind
that does say it (a simulated timeline, which records its placement; a run dump of a registered algorithm; Primus's
printed form with its header) for algorithms of each layout (interleaved at vpp 1 and 2, the V), each command that
reads the kind, and each layout name: the layout the input ran on is accepted (sound), the other one is refused in
one line naming ``--placement``; a layout the input's shape cannot hold (the V at vpp 1) names it too.

Defects this family found: ``vis sim/zbv.timeline.json --placement interleaved`` drew a V run as interleaved without a
word (the flag overrode what the timeline recorded), ``calibrate`` of it ended in a deadlock diagnosis of the
re-derived table naming no flag, ``validate zbv.txt --placement interleaved`` (a header saying ``placement=v``) said
``(SF|0|1) moves data past the first or last stage``, and ``--placement v`` at vpp 1 was "the V-shape placement needs
vpp = 2" naming neither the flag nor the header."""

from __future__ import annotations

import pytest

from hostile_support import accepted, make_dump, refused, run_cli

ALGORITHMS = {"1f1b": (1, "interleaved"), "interleaved-1f1b": (2, "interleaved"), "zbv": (2, "v")}
"""An algorithm of each layout: its vpp and the layout it runs on."""
LAYOUTS = ("interleaved", "v")


def _inputs(tmp, algorithm: str) -> dict[str, tuple[str, ...]]:
    """Each input kind of ``algorithm`` that records its layout, with the commands that read it."""
    vpp, _ = ALGORITHMS[algorithm]
    shape = ["--pp", "2", "--vpp", str(vpp), "-m", "4"]
    assert run_cli(["simulate", "-a", algorithm, *shape, "-o", tmp / "sim"]).code == 0
    assert run_cli(["export", algorithm, *shape, "--format", "primus", "-o", tmp / "table.txt"]).code == 0
    return {str(tmp / "sim" / f"{algorithm}.timeline.json"): ("vis", "calibrate"),
            str(make_dump(tmp / "dump", pp=2, algorithm=algorithm)): ("vis", "calibrate"),
            str(tmp / "table.txt"): ("validate",)}


CASES = [(algorithm, kind, layout) for algorithm in ALGORITHMS for kind in ("timeline", "dump", "primus")
         for layout in LAYOUTS]


@pytest.mark.parametrize("algorithm, kind, layout", CASES)
def test_a_placement_beside_an_input_that_records_one(tmp_path, algorithm, kind, layout):
    inputs = _inputs(tmp_path, algorithm)
    path = next(p for p in inputs if {"timeline": "timeline.json", "dump": "dump", "primus": ".txt"}[kind] in p)
    vpp, ran_on = ALGORITHMS[algorithm]
    for command in inputs[path]:
        outcome = run_cli([command, path, "--placement", layout])
        case = f"{command} {kind} of {algorithm} --placement {layout}"
        if layout == ran_on:
            accepted(outcome, case=case)
        else:
            refused(outcome, "placement", layout, case=case)


def test_a_placement_for_a_text_without_its_header(tmp_path):
    """Where the text does not say, ``--placement`` names the layout: the V at vpp 1 is refused naming the flag."""
    assert run_cli(["export", "1f1b", "--pp", "2", "-m", "4", "--format", "primus", "-o", tmp_path / "t.txt"]).code == 0
    bare = tmp_path / "bare.txt"
    bare.write_text("".join(line for line in (tmp_path / "t.txt").read_text().splitlines(True)
                            if not line.startswith("#")))
    accepted(run_cli(["validate", bare, "--placement", "interleaved"]), case="validate a headless text, interleaved")
    refused(run_cli(["validate", bare, "--placement", "v"]), "--placement", "vpp", case="validate a headless text, v")
