"""Round thirteen: a subcommand that reads several files (``calibrate RUN [RUN ...]``) given its options between the
files, as a shell user writes them -- ``calibrate run1 -o c.yaml run2``. argparse takes one run of positionals, so the
second run was "unrecognized arguments: run2" (a valid command line refused, its message blaming the run). Generated
from the parser: every option of every such subcommand between two runs is read as it is read after both, with the
same result; and an unknown option there is still one usage line naming it."""

from __future__ import annotations

import argparse

import pytest

from hostile_support import accepted, refused, run_cli, subcommands

VALUES = {"-o": "OUT", "--warmup": "0", "--placement": "interleaved"}
"""A valid value for each option of the subcommands below that takes one."""


def _several() -> dict[str, argparse.ArgumentParser]:
    """The subcommands whose positional takes several values."""
    return {name: p for name, p in subcommands().items()
            if any(not a.option_strings and a.nargs in ("+", "*") for a in p._actions)}


def _cases():
    for name, parser in sorted(_several().items()):
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                flag = action.option_strings[0]
                yield name, [flag] if action.nargs == 0 else [flag, VALUES[flag]]


def test_the_sweep_knows_each_such_command():
    assert set(_several()) == {"calibrate"}, "a new subcommand reads several files: add its runs to _runs()"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("order")
    for run in ("a", "b"):
        assert run_cli(["simulate", "-a", "1f1b", "--pp", "2", "-m", "4", "-o", tmp / run]).code == 0
    return tmp, [tmp / "a" / "1f1b.timeline.json", tmp / "b" / "1f1b.timeline.json"]


@pytest.mark.parametrize("command, tokens", list(_cases()), ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_option_between_runs(runs, command, tokens):
    tmp, (first, second) = runs
    tokens = [tmp / "between.yaml" if t == "OUT" else t for t in tokens]
    between = run_cli([command, first, *tokens, second])
    accepted(between, case=f"{command} RUN {' '.join(map(str, tokens)).replace(str(tmp), '')} RUN")
    after = run_cli([command, first, second, *[tmp / "after.yaml" if t == tmp / "between.yaml" else t for t in tokens]])
    assert between.out.replace("between", "after") == after.out


def test_unknown_option_between_runs(runs):
    _, (first, second) = runs
    refused(run_cli(["calibrate", first, "--nosuch", second]), "--nosuch", case="calibrate RUN --nosuch RUN")
