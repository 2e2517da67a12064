"""YAML's typed tags in every YAML input, at a field that takes a number or a list of numbers: ``!!binary``,
``!!set``, ``!!omap``, ``!!pairs``, dates, Python's own tags. No primuspipe field takes such a value; each is
refused in one line naming the file, never read as something else.

Defect this family found: the strict loader was PyYAML's safe one, which builds ``!!binary aGk=`` as the bytes
``b"hi"``; a cost file's ``f: !!binary aGk=`` then read as the per-stage times ``[104, 105]`` (bytes are a
sequence of ints) and ``simulate`` ranked schedules on them -- a silent wrong result. Round ten adds the YAML 1.1
number forms other readers read otherwise and values their tag cannot build (:data:`UNREADABLE`)."""

from pathlib import Path

import pytest

from hostile_support import refused, run_api, run_cli
from primuspipe.backends.megatron.config import load_config

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
MODEL, HARDWARE = EXAMPLES / "models" / "llama3-8b.yaml", EXAMPLES / "hardware" / "h100.yaml"
TRAINING = EXAMPLES / "training" / "default.yaml"
COST = "time_unit: s\ncompute:\n  f: [0.01, 0.01]\n  b: [0.01, 0.01]\n  w: [0.01, 0.01]\n"
PROJECT = ["project", "--pp", "2", "--algorithm", "1f1b", "--json"]

TAGGED = {"binary": "!!binary aGk=", "binary list": "[!!binary aGk=, 1]", "set": "!!set {1, 2}",
          "omap": "!!omap [a: 1, b: 2]", "pairs": "!!pairs [a: 1, a: 2]", "date": "2001-12-14",
          "timestamp": "2001-12-14t21:59:43.10-05:00", "python tuple": "!!python/tuple [1, 2]",
          "python bytes": "!!python/bytes aGk=", "python name": "!!python/name:os.getcwd ''"}
"""Values a YAML file can give that are no number, text, list or mapping."""

INPUTS = {
    "cost file": (COST, "  f: [0.01, 0.01]\n", "  f: {}\n",
                  lambda p: ["simulate", "--algorithm", "zb-h1", "--pp", "2", "--microbatches", "4", "--cost", p]),
    "model file": (MODEL.read_text(), "hidden_size: 4096\n", "hidden_size: {}\n",
                   lambda p: [*PROJECT, "--model", p, "--hardware", HARDWARE]),
    "hardware file": (HARDWARE.read_text(), "gpus_per_node: 8\n", "gpus_per_node: {}\n",
                      lambda p: [*PROJECT, "--model", MODEL, "--hardware", p]),
    "training file": (TRAINING.read_text(), "micro_batch_size: 1\n", "micro_batch_size: {}\n",
                      lambda p: [*PROJECT, "--model", MODEL, "--hardware", HARDWARE, "--training", p]),
    "primuspipe config": ("patch_primus_pipeline: true\npp_cost_f: 1\n", "pp_cost_f: 1\n", "pp_cost_f: {}\n", None),
}
"""Input -> (valid text, the line to replace, its tagged form, the command that reads it; None: ``load_config``)."""

UNREADABLE = {"octal": "010", "signed octal": "-07", "base 60": "1:30", "base-60 float": "1:30.5",
              "int tag on a fraction": "!!int 0.01", "float tag on text": "!!float abc",
              "bool tag on a digit": "!!bool 1",
              "timestamp tag on text": "!!timestamp x", "empty int tag": "!!int", "map tag on a list": "!!map [1]",
              "seq tag on a mapping": "!!seq {a: 1}", "integer of 5000 digits": "9" * 5000}
"""Numbers PyYAML reads as YAML 1.1 does (``010`` is 8, ``1:30`` is 90; a YAML 1.2 reader and a person read 10 and
text), and values their tag cannot build (PyYAML let out int()'s ValueError, a KeyError, a TypeError)."""

CASES = [(kind, tag) for kind in INPUTS for tag in TAGGED]
UNREADABLE_CASES = [(kind, form) for kind in INPUTS for form in UNREADABLE]


def _read(kind: str, value: str, tmp_path):
    text, line, tagged, command = INPUTS[kind]
    assert line in text, f"{kind}: the example no longer holds {line!r}"
    path = tmp_path / "input.yaml"
    path.write_text(text.replace(line, tagged.format(value), 1))
    return path, run_api(lambda: load_config(path, env={}).check()) if command is None else run_cli(command(path))


@pytest.mark.parametrize("kind, tag", CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_tagged_value_refused(kind, tag, tmp_path):
    path, outcome = _read(kind, TAGGED[tag], tmp_path)
    refused(outcome, str(path), case=f"{kind} with a {tag} value")


@pytest.mark.parametrize("kind, form", UNREADABLE_CASES, ids=[f"{k}-{f}" for k, f in UNREADABLE_CASES])
def test_number_read_otherwise_or_unbuildable_refused(kind, form, tmp_path):
    """Round ten: ``f: 010`` simulated with f = 8, ``f: 1:30`` with 90; ``!!int 0.01``, ``!!bool 1``, ``!!map [1]``
    and an integer past Python's 4,300 digits were tracebacks. Each is now a YAML error naming the file and line."""
    path, outcome = _read(kind, UNREADABLE[form], tmp_path)
    refused(outcome, str(path), case=f"{kind} with {form}")
