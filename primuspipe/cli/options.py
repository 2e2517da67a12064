"""Argument helpers shared by the sub-commands: strict number types, algorithm options, output paths.

Every number on the command line goes through :mod:`primuspipe.strict`: counts are ASCII integers,
times and limits finite numbers (``--f inf`` and ``-m 2.5`` are refused by argparse with the flag's
name). Outputs are checked before any work is done, so a command that cannot write its result fails
at once and writes nothing.
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, PrimusPipeError
from primuspipe import strict


def _argument_type(parse: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse ``type`` from a strict parser: its refusal becomes argparse's one-line error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except PrimusPipeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what
    return convert


def count_type(minimum: int = 1) -> Callable[[str], int]:
    return _argument_type(lambda t: strict.count(t, "the value", minimum=minimum, text=True), "integer")


def number_type(minimum: float | None = 0.0, above: float | None = None,
                maximum: float | None = None) -> Callable[[str], float]:
    return _argument_type(lambda t: strict.number(t, "the value", minimum=minimum, above=above, maximum=maximum),
                          "number")


def numbers_type(text: str) -> float | list[float]:
    """One finite number >= 0, or a comma-separated list of them (one per stage)."""
    parse = _argument_type(lambda t: strict.number(t, "every value", minimum=0), "numbers")
    values = [parse(v) for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def described(description: str, examples: list[str]) -> dict[str, Any]:
    """``add_parser`` keywords for a command's help: the description filled to the width the other commands'
    help is written at, and an ``examples:`` section printed as written (argparse would rewrap a command line
    into a different command)."""
    return dict(description=textwrap.fill(description, 104), formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="examples:\n" + "\n".join(f"  {line}" for line in examples))


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--pp, --vpp, -m and -O; --pp and --vpp also answer to Megatron-LM's names for them, as
    examples/train_gpt.py does, so a Megatron command line's values can be pasted."""
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=count_type(), required=True,
                        help="pipeline-parallel size (ranks)")
    parser.add_argument("--vpp", "--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
                        dest="vpp", type=count_type(), default=None,
                        help="chunks per rank (default: what the algorithm needs, else its default: 1, or 2 for "
                             "interleaved-1f1b)")
    parser.add_argument("--microbatches", "-m", type=count_type(), required=True, help="microbatches per step")
    parser.add_argument("--option", "-O", action="append", default=[], metavar="KEY=VALUE",
                        help="algorithm option, e.g. -O microbatch_group_size=4 (see 'primuspipe list'); integers and "
                             "numbers (1e-3) are read as numbers, true/false as booleans, none as unset; repeatable")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings to a dict (values: :func:`primuspipe.strict.scalar`); the algorithm
    checks the names and types (:meth:`~primuspipe.algorithms.registry.AlgorithmInfo.check_options`).
    A key that names one of ``build_schedule``'s own parameters (``vpp``, ``memory_limit``, ``communication``) is
    refused here: passed on beside the command's own value it was a TypeError, or set what a flag sets."""
    own = [name for name, p in inspect.signature(build_schedule).parameters.items() if p.kind is not p.VAR_KEYWORD]
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"option {pair!r} must look like KEY=VALUE, e.g. -O microbatch_group_size=4")
        if key in own:
            raise ConfigError(f"option {key} is not an algorithm's option but the command's own setting; give it "
                              f"with the command's flag (--{key.replace('_', '-')}) where it has one")
        if key in options:
            raise ConfigError(f"option {key} is given twice (-O {key}=...); give it once")
        options[key] = strict.scalar(value, f"option {key}")
    return options


def output_dir(path: Path, flag: str) -> Path:
    """Check, before any work, that ``path`` is a directory that can be written into (created if missing)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} exists and is not a directory; give a directory")
    strict.writable_folder(path, f"{flag} {path}")
    return path


def console(**kwargs: Any) -> Console:
    """A rich console that prints text as it is (no markup: a bracket in a name or path stays) and keeps
    wide tables readable when output goes to a file or a pipe."""
    out = Console(markup=False, **kwargs)
    if not out.is_terminal:
        out.width = 160
    return out


def report_console() -> Console:
    """The :func:`console` commands print their reports on: no automatic colouring of numbers and
    paths, and long lines (error reasons, file names) left whole rather than wrapped."""
    return console(highlight=False, soft_wrap=True)
