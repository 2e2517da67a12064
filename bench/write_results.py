"""The end every bench script shares: ``--output`` (JSON results, with the machine they were measured
on, under bench/results/) and ``--markdown`` (the table, else printed)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def run_bench(doc: str, name: str, produce: Callable[[], tuple[dict, str]]) -> None:
    """Parse the command line, run ``produce`` (-> JSON payload, markdown) and write both."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=RESULTS / f"{name}.json")
    parser.add_argument("--markdown", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    payload, table = produce()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(), **payload},
                                      indent=1))
    if args.markdown:
        args.markdown.write_text(table)
    else:
        sys.stdout.write(table)


def markdown_table(header: list[str], rows: Iterable[list[str]]) -> str:
    """A markdown table of ``header`` and one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(cells) + " |" for cells in rows)]) + "\n"
