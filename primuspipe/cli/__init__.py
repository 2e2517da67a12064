"""The ``primuspipe`` console script.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds its parser and
sets ``handler`` (a function of the parsed args returning an exit status). Library errors
(:class:`~primuspipe.errors.PrimusPipeError`) end the program with their message and status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console

from primuspipe.errors import PrimusPipeError

COMMAND_MODULES = ("primuspipe.cli.schedule_commands", "primuspipe.cli.simulate_command")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primuspipe",
        description="Build, inspect, validate and simulate pipeline-parallel schedules.",
        epilog="Run 'primuspipe COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except PrimusPipeError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {exc}", markup=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
