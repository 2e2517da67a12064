"""The command output README.md shows is what the command prints: each ``$ primuspipe ...`` of its
Projection block, run as written, prints the same title line and the same table header (the columns a
reader looks for). The figures are left to move with the model (bench/ tracks them)."""

import re
import shlex
from pathlib import Path

import pytest

from doc_examples import run_example
from hostile_support import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _shown() -> list[tuple[str, list[str]]]:
    """(command, lines shown after it) for every ``$ primuspipe`` line of README.md's code blocks."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"```\n(\$ primuspipe .*?)```", text, flags=re.S):
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            lines = part.replace("\\\n", " ").splitlines()
            found.append((lines[0], lines[1:]))
    return found


SHOWN = _shown()


def test_readme_shows_commands():
    assert len(SHOWN) >= 2


@pytest.mark.parametrize("command, lines", SHOWN, ids=[c[:60] for c, _ in SHOWN])
def test_readme_output_has_the_commands_title_and_columns(command, lines, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    outcome = run_cli(shlex.split(command)[1:])
    assert outcome.code == 0, outcome.err
    printed = outcome.out.splitlines()
    header = [line for line in printed if line.startswith("┃")]
    assert printed[0] == lines[0], f"title: README shows {lines[0]!r}, the command prints {printed[0]!r}"
    assert [line for line in lines if line.startswith("┃")] == header, "README's table header is not the command's"


def _using_it() -> list[str]:
    """The command lines of README.md's 'Using it' block, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it\n+```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_using_it_runs_as_written(tmp_path, monkeypatch):
    """Every line of 'Using it' that needs no run of the user's (no torchrun, no dump, no cost file) runs as
    pasted, in order, in an empty folder: no ``[--optional]`` syntax, no file nobody made."""
    monkeypatch.chdir(tmp_path)
    lines = [line for line in _using_it() if line.startswith("primuspipe ")]
    runnable = [line for line in lines if "pp_data" not in line and "--cost" not in line]
    assert len(runnable) >= 8, runnable
    for line in runnable:
        run_example(line)
