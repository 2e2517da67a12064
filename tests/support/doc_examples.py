"""Running the ``primuspipe`` command lines that help texts and docs show, as a reader would paste them."""

from __future__ import annotations

import shlex

from hostile_support import run_cli


def run_example(example: str) -> None:
    """Run one shown line (steps joined by ``&&``, a trailing ``# comment``) in the current folder, in process;
    each step must end with status 0, or 1 where the comment says 'exit 1'."""
    expected = 1 if "exit 1" in example else 0
    for step in " ".join(shlex.split(example, comments=True)).split(" && "):
        argv = shlex.split(step)
        assert argv[0] == "primuspipe", example
        outcome = run_cli(argv[1:])
        assert outcome.code == expected, f"{example}: exit {outcome.code}\n{outcome.err}{outcome.out[-2000:]}"
