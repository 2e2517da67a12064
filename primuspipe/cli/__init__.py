"""The ``primuspipe`` console script.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds its parser and
sets ``handler`` (a function of the parsed args returning an exit status). Library errors
(:class:`~primuspipe.errors.PrimusPipeError`) and failed file writes end the program with one plain-text
line, ``error: ...``, and status 1 (130 when interrupted); malformed arguments are argparse's (status 2). Nothing the user
typed is read as markup. The library reports progress through :mod:`logging` (e.g. zb-auto's search,
iterations a dump reader skipped); the command shows it on stderr, ``--quiet`` hides all but warnings, and
a command's own notes beside its results (``calibrate``'s) too. ``-q`` and ``-v`` go before or after the
command name.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import sys

from primuspipe import strict
from primuspipe.cli.parser import Parser
from primuspipe.errors import PrimusPipeError

COMMAND_MODULES = ("primuspipe.cli.schedule_commands", "primuspipe.cli.simulate_command", "primuspipe.cli.vis_command",
                   "primuspipe.cli.project_command")

_EPILOG = """\
examples (which schedule before a run):
  primuspipe list                                              # the algorithms and their options
  primuspipe simulate --algorithm all --pp 8 -m 32             # every algorithm ranked at pp 8, 32 microbatches
  primuspipe project --model examples/projection/models/llama2-7b.yaml \\
      --hardware examples/projection/hardware/mi300x.yaml      # a model on a cluster: step time, memory, MFU

Run 'primuspipe COMMAND --help' for a command's options and examples."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="primuspipe",
        description="Build, inspect, validate and simulate pipeline-parallel schedules.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_noise_flags(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for command in dict.fromkeys(sub.choices.values()):
        _add_noise_flags(command, default=argparse.SUPPRESS)
    return parser


def _add_noise_flags(parser: argparse.ArgumentParser, default) -> None:
    """-q / -v, on the program and again on every sub-command: ``primuspipe calibrate -q`` reads as
    ``primuspipe -q calibrate`` (argparse refused the first). A sub-command's copies default to SUPPRESS, so
    they never undo the program's flag; given on both sides, -q and -v are refused in ``_run``."""
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument("-q", "--quiet", action="store_true", default=default,
                       help="show no progress or notes, only results, warnings and errors")
    noise.add_argument("-v", "--verbose", action="store_true", default=default, help="also show debug messages")


def main(argv: list[str] | None = None) -> int:
    with _young_collections_only():
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quiet and args.verbose:
        parser.error("argument -q/--quiet: not allowed with argument -v/--verbose")
    _show_progress(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.handler(args)
    except PrimusPipeError as exc:
        _error(str(exc), argv)
    except BrokenPipeError:  # the reader went away (``| head``): no error to report, and none at exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as exc:  # a file that cannot be read or written: the path and the reason, not a traceback
        where = f" {exc.filename}" if exc.filename else ""
        _error(f"cannot access{where}: {exc.strerror or exc}", argv)
    except KeyboardInterrupt:
        _error("interrupted", argv)
        return 130
    return 1


@contextlib.contextmanager
def _young_collections_only():
    """CPython's collector without its full collections while a command runs. A command builds one large
    table of immutable nodes and its passes' indexes, alive to its end: each full collection walks every one
    of them again and frees none (at 391k nodes about 0.4 s of a 3 s ``simulate``, bench_simulator.py).
    The young generations are still collected, where short-lived cycles die; the setting is restored after
    (``main`` also runs in-process, from tests and tools)."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, 1_000_000)  # full collections after a million middle ones: never here
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)


def _error(message: str, argv: list[str]) -> None:
    """One ``error:`` line; a file name the user typed is printed escaped wherever the message repeats it."""
    sys.stderr.write(f"error: {strict.printable(strict.paths_shown(message, argv))}\n")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (tests and tools swap it)."""

    @property
    def stream(self):  # noqa: ANN201 - logging's attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


class _PlainFormatter(logging.Formatter):
    """Progress as it is; warnings and errors prefixed with their level, in plain text."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        return f"{record.levelname.lower()}: {text}" if record.levelno >= logging.WARNING else text


def _show_progress(level: int) -> None:
    """The command's messages on standard error, once: they do not propagate to the root logger, which
    a library may configure for itself (``megatron.training`` calls ``logging.basicConfig`` with a
    standard-output handler on import), where they would print again, on standard output, inside --json."""
    logger = logging.getLogger("primuspipe")
    logger.setLevel(level)
    logger.propagate = False
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_PlainFormatter())
        logger.addHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
