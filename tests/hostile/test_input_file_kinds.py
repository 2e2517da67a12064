"""Every file a subcommand reads, found from the parser itself (so a new file option joins the sweep or fails it),
given every kind of file that is not what it asks for: empty, blank, NUL bytes, binary, UTF-16, an oversized file,
keys YAML reads as numbers or null, a list or a number where a mapping belongs, nesting past any format's depth,
truncated JSON, JSON's ``NaN``, a directory, a missing path. Each is one line that names the file.

Defects this family found: ``show``/``export``/``vis --cost`` and ``project --measured-costs`` refused a cost file's
content naming "cost model", not the file (``CostModel.load`` gave its reader no name)."""

import argparse
from pathlib import Path

import pytest

from hostile_support import make_dump, refused, run_cli
from primuspipe.cli import build_parser
from primuspipe.strict import MAX_DOCUMENT_BYTES

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
HW, MODEL, TRAINING = (EXAMPLES / "hardware" / "h100.yaml", EXAMPLES / "models" / "llama2-7b.yaml",
                       EXAMPLES / "training" / "default.yaml")
OUTPUTS = {"output", "output_dir", "png", "html", "trace", "graph"}
"""Options that name files the command writes (checked by tests/hostile/test_outputs.py)."""


def _inputs() -> set[tuple[str, str]]:
    """(subcommand, dest) of every option or positional that names a file to read."""
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {(name, a.dest) for name, p in sub.choices.items() for a in p._actions
            if a.dest not in OUTPUTS and (a.type is Path or "FILE" in str(a.metavar or ""))}


def _argv(tmp, f) -> dict[tuple[str, str], list]:
    """A command line reading ``f`` through each input; the other inputs valid."""
    timeline = tmp / "sim" / "1f1b.timeline.json"
    sim = ["-a", "1f1b", "--pp", "2", "-m", "4", "-o", tmp / "out"]
    return {
        ("show", "cost"): ["show", "1f1b", "--pp", "2", "-m", "4", "--offload", "4", "--cost", f],
        ("export", "cost"): ["export", "1f1b", "--pp", "2", "-m", "4", "--offload", "4", "--cost", f,
                             "-o", tmp / "t.json"],
        ("validate", "file"): ["validate", f],
        ("simulate", "cost"): ["simulate", *sim, "--cost", f],
        ("simulate", "plan_cost"): ["simulate", *sim, "--plan-cost", f],
        ("vis", "input"): ["vis", f, "--html", tmp / "o.html"],
        ("vis", "compare"): ["vis", timeline, "--compare", f, "--html", tmp / "o.html"],
        ("vis", "cost"): ["vis", timeline, "--cost", f, "--html", tmp / "o.html"],
        ("calibrate", "input"): ["calibrate", f, "-o", tmp / "c.yaml"],
        ("project", "model"): ["project", "--model", f, "--training", TRAINING, "--hardware", HW, "-a", "1f1b"],
        ("project", "training"): ["project", "--model", MODEL, "--training", f, "--hardware", HW, "-a", "1f1b"],
        ("project", "hardware"): ["project", "--model", MODEL, "--training", TRAINING, "--hardware", f, "-a", "1f1b"],
        ("project", "megatron_config"): ["project", "--megatron-config", f, "--hardware", HW, "-a", "1f1b"],
        ("project", "measured_costs"): ["project", "--model", MODEL, "--training", TRAINING, "--hardware", HW,
                                        "-a", "1f1b", "--measured-costs", f],
    }


KINDS = {
    "empty": b"", "blank": b"  \n\t\n", "NUL bytes": b"\0" * 64, "binary": bytes(range(256)),
    "UTF-16": "a: 1\n".encode("utf-16"), "integer key": b"1: 2\n", "boolean key": b"true: 2\n",
    "null key": b"null: 2\n", "YAML list": b"- 1\n- 2\n", "number": b"42\n", "YAML NaN": b".nan\n",
    "nested past any depth": b"[" * 200 + b"]" * 200,
    "JSON list": b"[1, 2]", "JSON NaN": b'{"pp": NaN}', "truncated JSON": b'{"format": "primuspipe.timeline", "pp": [1',
    "tab-indented YAML": b"a:\t1\n\tb: 2\n", "terminal escapes": b"\x1b[31mred\x1b[0m: 1\n",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inputs")
    assert run_cli(["simulate", "-a", "1f1b", "--pp", "2", "-m", "4", "-o", tmp / "sim"]).code == 0
    huge = tmp / "huge.yaml"
    with huge.open("wb") as f:  # sparse: past the reader's limit without writing it
        f.truncate(MAX_DOCUMENT_BYTES + 1)
    return tmp


def test_every_input_is_swept():
    assert _inputs() == set(_argv(Path("."), "f")), "a file option is missing from the sweep (add its command line)"


@pytest.mark.parametrize("option", sorted(_argv(Path("."), "f")), ids="/".join)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_content(world, tmp_path, option, kind):
    f = tmp_path / ("input.json" if "JSON" in kind else "input.yaml")
    f.write_bytes(KINDS[kind])
    refused(run_cli(_argv(world, f)[option]), str(f), case=f"{' '.join(option)} given {kind}")


@pytest.mark.parametrize("option", sorted(_argv(Path("."), "f")), ids="/".join)
@pytest.mark.parametrize("kind", ["directory", "missing", "oversized", "NUL in its name"])
def test_not_a_readable_document(world, tmp_path, option, kind, monkeypatch):
    """A NUL (round thirteen) can reach main() from Python only, not from a shell: beside an output it was a ValueError
    traceback in the check that the output is no input (os.path.realpath). Named relative to the case's folder: the
    readers print a path that is no path as its repr, cut short."""
    monkeypatch.chdir(tmp_path)
    f = {"directory": tmp_path, "missing": tmp_path / "missing.yaml", "oversized": world / "huge.yaml",
         "NUL in its name": Path("a\0b.yaml")}[kind]
    if (option, kind) in ((("vis", "input"), "directory"), (("calibrate", "input"), "directory")):
        f = make_dump(tmp_path / "d", iterations=())  # an empty dump folder: those two read folders
        f.mkdir()
    shown = str(f).replace("\0", "\\x00")  # printed escaped (strict.shown_path)
    refused(run_cli(_argv(world, f)[option]), shown, case=f"{' '.join(option)} given {kind}")
