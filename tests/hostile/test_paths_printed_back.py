"""File names printed back: every command's file argument named with a newline, a carriage return, a tab, a
terminal escape sequence or a right-to-left override in it, the file missing, a directory, or holding garbage;
and outputs written under such a name. Each refusal is one line that names the file escaped (``a\\nb``), and no
line a command prints holds the raw character -- a script reading the first line sees the whole message, and a
name never drives the terminal.

Defects this family found: ``validate 'a<newline>b.json'`` printed ``INVALID a`` and ``b.json: ...`` on two lines
(and ``valid: a`` for a valid table); ``error: cannot read schedule file a<newline>b`` likewise from every reader;
``export -o`` printed ``wrote a<newline>b.json``; argparse's ``unrecognized arguments`` quoted one raw;
``vis``/``calibrate``'s ``wrote`` lines read ``[...]`` in a name as console markup (a name ``[bold]x.png`` was
printed ``x.png``). One helper (``strict.shown_path``) prints a path; the CLI escapes a typed name wherever a
message repeats it.
"""

from pathlib import Path

import pytest

from hostile_support import accepted, refused, run_cli

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
CHARACTERS = {"newline": "\n", "carriage return": "\r", "tab": "\t", "escape": "\x1b[2J", "rtl override": "\u202e"}
STATES = {"missing": None, "directory": "dir", "garbage": "{not json: ["}


def _doors(path: Path) -> dict[str, list]:
    """Commands reading ``path`` as their file argument."""
    return {
        "validate": ["validate", path],
        "simulate --cost": ["simulate", "-a", "1f1b", "--pp", "2", "-m", "4", "--cost", path],
        "vis": ["vis", path, "--json"],
        "calibrate": ["calibrate", path, "-o", path.parent / "c.yaml"],
        "project --model": ["project", "--model", path, "--training", EXAMPLES / "training" / "mixtral-8x7b.yaml",
                            "--hardware", EXAMPLES / "hardware" / "h100.yaml", "-a", "1f1b"],
    }


def _printed_on_one_line(outcome, case: str) -> None:
    """The command printed one line (argparse's usage line aside), holding no raw character."""
    lines = [line for line in (outcome.out + outcome.err).split("\n") if line and not line.startswith("usage:")]
    assert len(lines) == 1 and lines[0].isprintable(), f"{case}: printed {lines!r}"


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("what", sorted(CHARACTERS))
@pytest.mark.parametrize("door", sorted(_doors(Path("x"))))
def test_file_arguments(tmp_path, door, what, state):
    path = tmp_path / f"in{CHARACTERS[what]}put.json"
    if STATES[state] == "dir":
        path.mkdir()
    elif STATES[state] is not None:
        path.write_text(STATES[state])
    case = f"{door} of a {state} file named with a {what}"
    outcome = refused(run_cli(_doors(path)[door]), ascii(CHARACTERS[what])[1:-1], case=case)
    _printed_on_one_line(outcome, case)


@pytest.mark.parametrize("what", sorted(CHARACTERS))
def test_outputs_named_back(tmp_path, what):
    table = tmp_path / f"t{CHARACTERS[what]}[bold]x.json"
    outcome = accepted(run_cli(["export", "1f1b", "--pp", "2", "-m", "4", "-o", table]), case=f"export to a {what}")
    _printed_on_one_line(outcome, f"export to a name with a {what}")
    assert "[bold]" in outcome.err, outcome.err
    outcome = accepted(run_cli(["validate", table]), case=f"validate a name with a {what}")
    _printed_on_one_line(outcome, f"validate a name with a {what}")


@pytest.mark.parametrize("what", sorted(CHARACTERS))
def test_unknown_arguments_quoted(tmp_path, what):
    outcome = refused(run_cli(["validate", tmp_path / "t.json", f"--bogus{CHARACTERS[what]}"]), "unrecognized",
                      case=f"an unknown argument with a {what}")
    _printed_on_one_line(outcome, f"an unknown argument with a {what}")
