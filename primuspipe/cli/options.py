"""Argument helpers shared by the sub-commands."""

from __future__ import annotations

import argparse
from typing import Any

import yaml
from rich.console import Console

from primuspipe.errors import ConfigError


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size (ranks)")
    parser.add_argument("--vpp", type=int, default=None, help="chunks per rank (default: what the algorithm needs, else its default: 1, or 2 for interleaved-1f1b)")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches per step")
    parser.add_argument("--option", "-O", action="append", default=[], metavar="KEY=VALUE",
                        help="algorithm option, e.g. -O microbatch_group_size=4 (see 'primuspipe list'); repeatable")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings to a dict; values are read as YAML scalars (numbers, booleans, strings)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"option {pair!r} must look like KEY=VALUE")
        options[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return options


def console(**kwargs: Any) -> Console:
    """A rich console that keeps wide tables readable when output goes to a file or a pipe."""
    out = Console(**kwargs)
    if not out.is_terminal:
        out.width = 160
    return out


def report_console() -> Console:
    """The :func:`console` commands print their reports on: no automatic colouring of numbers and
    paths, and long lines (error reasons, file names) left whole rather than wrapped."""
    return console(highlight=False, soft_wrap=True)
