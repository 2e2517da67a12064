"""The ``primuspipe`` console script.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds its parser and
sets ``handler`` (a function of the parsed args returning an exit status). Library errors
(:class:`~primuspipe.errors.PrimusPipeError`) end the program with their message and status 1. The
library reports progress through :mod:`logging` (e.g. zb-auto's search); the command shows it on
stderr, ``--quiet`` hides it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from rich.console import Console
from rich.logging import RichHandler

from primuspipe.errors import PrimusPipeError

COMMAND_MODULES = ("primuspipe.cli.schedule_commands", "primuspipe.cli.simulate_command", "primuspipe.cli.vis_command",
                   "primuspipe.cli.project_command")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primuspipe",
        description="Build, inspect, validate and simulate pipeline-parallel schedules.",
        epilog="Run 'primuspipe COMMAND --help' for a command's options.",
    )
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument("-q", "--quiet", action="store_true", help="show no progress, only results and errors")
    noise.add_argument("-v", "--verbose", action="store_true", help="also show debug messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _show_progress(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.handler(args)
    except PrimusPipeError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {exc}", markup=True)
        return 1


def _show_progress(level: int) -> None:
    logger = logging.getLogger("primuspipe")
    logger.setLevel(level)
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
