"""Every kind of input file a command reads -- schedule JSON, torch CSV, Primus's printed table, cost YAML,
timeline JSON, model and hardware YAML, the Megatron config YAML -- as editors and other systems save it: with a
UTF-8 byte-order mark, CRLF or old-Mac CR line ends, blank lines first, no final newline, tab indents; and as
what no reader can take: UTF-16/UTF-32, a trailing NUL, trailing garbage. A file that says the same thing is
read as the same file (sound); one that cannot be read is refused in one line naming it.

Defects this family found: a UTF-8 byte-order mark (Notepad's default) made a schedule or timeline JSON
"not valid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)" and a torch CSV's first action
``'\\ufeff0UNSHARD'`` unreadable, while every YAML reader took it; a CSV with CR line ends was refused with
Python's csv advice (``open the file in universal-newline mode``), one with blank lines first as a rank that
runs nothing; a YAML tab indent was refused without saying YAML takes spaces."""

import json
import shutil
from pathlib import Path

import pytest

from hostile_support import accepted, make_dump, refused, run_api, run_cli
from primuspipe.backends.megatron.config import load_config

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
MODEL, HARDWARE = EXAMPLES / "models" / "llama3-8b.yaml", EXAMPLES / "hardware" / "h100.yaml"
PROJECT = ["project", "--pp", "2", "--algorithm", "1f1b", "--json"]

KINDS = {
    "schedule json": ("t.json", lambda p: ["validate", p]),
    "torch csv": ("t.csv", lambda p: ["validate", p]),
    "primus table": ("t.txt", lambda p: ["validate", p]),
    "cost yaml": ("cost.yaml", lambda p: ["simulate", "--algorithm", "1f1b", "--pp", "2", "--microbatches", "4",
                                          "--cost", p]),
    "timeline json": ("sim/1f1b.timeline.json", lambda p: ["vis", p, "--json"]),
    "model yaml": (MODEL, lambda p: [*PROJECT, "--model", p, "--hardware", HARDWARE]),
    "hardware yaml": (HARDWARE, lambda p: [*PROJECT, "--model", MODEL, "--hardware", p]),
    "primuspipe config": ("config.yaml", None),
}
"""Input kind -> (its valid file, the command that reads it; None: read by ``load_config``)."""

SAME = {
    "UTF-8 byte-order mark": lambda b: b"\xef\xbb\xbf" + b,
    "CRLF line ends": lambda b: b.replace(b"\n", b"\r\n"),
    "CR line ends": lambda b: b.replace(b"\n", b"\r"),
    "blank lines first": lambda b: b"\n\n  \n" + b,
    "no final newline": lambda b: b.rstrip(b"\n"),
    "BOM and CRLF": lambda b: b"\xef\xbb\xbf" + b.replace(b"\n", b"\r\n"),
}
"""Spellings of a valid file that say the same thing."""

UNREADABLE = {
    "UTF-16": lambda b: b.decode().encode("utf-16"),
    "UTF-32": lambda b: b.decode().encode("utf-32"),
    "trailing NUL": lambda b: b + b"\x00",
    "trailing garbage": lambda b: b + b"\n}}garbage{{ ]]\n",
    "tab indent": lambda b: b.replace(b"\n  ", b"\n\t") if b"\n  " in b else b + b"\nextra:\n\tkey: 1\n",
}
"""Spellings no reader of the kind can take (a tab indent only in YAML; Primus's printed table sits in a log, so
lines around it that are no ``Rank r:`` line are the log's)."""
NOT_REFUSED = {("primus table", "trailing NUL"), ("primus table", "trailing garbage"), ("primus table", "tab indent"),
               ("schedule json", "tab indent"), ("timeline json", "tab indent"), ("torch csv", "tab indent")}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    for argv in (["export", "1f1b", "--pp", "2", "--microbatches", "4", "-o", root / "t.json"],
                 ["export", "1f1b", "--pp", "2", "--microbatches", "4", "--format", "csv", "-o", root / "t.csv"],
                 ["export", "1f1b", "--pp", "2", "--microbatches", "4", "--format", "primus", "-o", root / "t.txt"],
                 ["simulate", "--algorithm", "1f1b", "--pp", "2", "--microbatches", "4", "--f", "1", "--b", "1",
                  "--w", "1", "-o", root / "sim"]):
        assert run_cli(argv).code == 0, argv
    make_dump(root / "dump", pp=2)
    assert run_cli(["calibrate", root / "dump", "-o", root / "cost.yaml"]).code == 0
    (root / "config.yaml").write_text("patch_primus_pipeline: true\npp_algorithm: interleaved-1f1b\n"
                                      "algorithm_options:\n  microbatch_group_size: 2\n")
    return root


def _variant(inputs, tmp_path, kind, spell):
    source, command = KINDS[kind]
    source = inputs / source if not Path(source).is_absolute() else Path(source)
    path = tmp_path / source.name
    path.write_bytes(spell(source.read_bytes()))
    if kind == "torch csv":
        shutil.copy(inputs / "t.csv.meta.json", tmp_path / "t.csv.meta.json")
    if command is None:
        return path, run_api(lambda: load_config(path, env={}).check())
    return path, run_cli(command(path))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("spelling", list(SAME))
def test_same_file_other_spelling(kind, spelling, inputs, tmp_path):
    _, outcome = _variant(inputs, tmp_path, kind, SAME[spelling])
    accepted(outcome, case=f"{kind} with {spelling}")


CASES = [(k, s) for k in KINDS for s in UNREADABLE if (k, s) not in NOT_REFUSED]


@pytest.mark.parametrize("kind, spelling", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_unreadable_spelling_refused(kind, spelling, inputs, tmp_path):
    path, outcome = _variant(inputs, tmp_path, kind, UNREADABLE[spelling])
    names = [path.name] + (["tabs"] if spelling == "tab indent" else [])
    refused(outcome, *names, case=f"{kind} with {spelling}")
