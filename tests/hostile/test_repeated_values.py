"""Round fifteen: a value given twice to an option that lists values (``action="append"``: ``project -a``, ``-O``)
or that names what a command runs (``simulate -a``) -- generated from the parser, every such option of every
command, in each pair of its spellings.

``project -a 1f1b -a 1f1b`` ranked one row where the user typed two names, ``simulate -a zbv -a zbv`` simulated one
(a repeat of a list is most often a second name left unedited). Now each is argparse's one line naming the option
and the value; a different value given twice to a single-valued option was refused before (cli/parser.py)."""

from __future__ import annotations

import argparse
import itertools

import pytest

from hostile_support import refused, run_cli, subcommands


def _repeatable(action) -> bool:
    return isinstance(action, argparse._AppendAction) or type(action).__name__ == "_Single"


def _cases():
    for command, parser in subcommands().items():
        for action in parser._actions:
            if _repeatable(action):
                for first, second in itertools.product(action.option_strings, repeat=2):
                    yield f"{command} {first} {second}", [command, first, "x=1", second, "x=1"]


CASES = list(_cases())


@pytest.mark.parametrize("case, argv", CASES, ids=[c[0] for c in CASES])
def test_a_value_given_twice(case, argv):
    refused(run_cli(argv), argv[3], "x=1", "twice", case=case)


def test_every_command_that_lists_values_is_swept():
    """The generator finds the options it means (a parser change that hid them would leave the sweep empty)."""
    assert {case.split()[0] for case, _ in CASES} >= {"simulate", "project", "export"}
    assert {"simulate -a -a", "project -a -a"} <= {case for case, _ in CASES}
