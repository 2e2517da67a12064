"""``primuspipe COMMAND --help`` for every subcommand: exit 0 with a usage line and a description that explains
the command, and every option and positional documented. ``list`` and ``show`` had no description (their help
was the usage alone) and ``show``'s and ``export``'s ALGORITHM no help: a user was left guessing."""

import argparse

import pytest

from doc_examples import run_example
from hostile_support import record, run_cli
from primuspipe.cli import build_parser


def _subcommands():
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_help_explains_the_command(command):
    outcome = run_cli([command, "--help"])
    parser = _subcommands()[command]
    ok = outcome.code == 0 and outcome.out.startswith("usage: primuspipe") and len(parser.description or "") >= 40
    record("sound" if ok else "silent", f"{command} --help")
    assert ok, f"{command} --help: exit {outcome.code}, description {parser.description!r}"


@pytest.mark.parametrize("command, option", [(c, a.dest) for c, p in sorted(_subcommands().items())
                                             for a in p._actions if not isinstance(a, argparse._HelpAction)])
def test_every_option_has_help(command, option):
    [action] = [a for a in _subcommands()[command]._actions if a.dest == option]
    ok = bool(action.help and action.help.strip() and action.help != argparse.SUPPRESS)
    record("sound" if ok else "silent", f"{command} {'/'.join(action.option_strings) or option} help")
    assert ok, f"{command} {action.option_strings or option}: help {action.help!r}"


def _examples(parser: argparse.ArgumentParser) -> list[str]:
    """The command lines of a help text's ``examples`` section, continuation lines joined."""
    help_text = parser.format_help()
    assert "\nexamples" in help_text, f"{parser.prog} --help shows no examples"
    section = help_text.split("\nexamples", 1)[1].split("\n\n", 1)[0]
    lines = "\n".join(line.strip() for line in section.splitlines()[1:]).replace("\\\n", " ")
    return [line for line in lines.splitlines() if line]


@pytest.mark.parametrize("command", [None, *sorted(_subcommands())])
def test_help_shows_examples_of_the_command(command):
    """A user reads how a command is called before any option: every help ends with examples of it."""
    parser = build_parser() if command is None else _subcommands()[command]
    examples = _examples(parser)
    assert all(e.startswith("primuspipe ") for e in examples), examples
    assert any(f"primuspipe {command or ''}" in e for e in examples), examples


SELF_CONTAINED = ("list", "show", "export", "validate", "simulate")
"""Commands whose examples need no file of the user's (a run's dump, a model, a cost file: lines with --cost
are left out) and run in a few seconds."""


@pytest.mark.parametrize("command", SELF_CONTAINED)
def test_help_examples_run(command, tmp_path, monkeypatch):
    """Each example, run as written in an empty folder (the lines in order: a later one may read what an
    earlier one wrote), ends with status 0, or 1 where its comment says 'exit 1'."""
    monkeypatch.chdir(tmp_path)
    for example in _examples(_subcommands()[command]):
        if "--cost" not in example:
            run_example(example)
