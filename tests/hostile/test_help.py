"""``primuspipe COMMAND --help`` for every subcommand: exit 0 with a usage line and a description that explains
the command, and every option and positional documented. ``list`` and ``show`` had no description (their help
was the usage alone) and ``show``'s and ``export``'s ALGORITHM no help: a user was left guessing."""

import argparse

import pytest

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
