"""YAML's typed tags in every YAML input, at a field that takes a number or a list of numbers: ``!!binary``,
``!!set``, ``!!omap``, ``!!pairs``, dates, Python's own tags. No primuspipe field takes such a value; each is
refused in one line naming the file, never read as something else.

Defect this family found: the strict loader was PyYAML's safe one, which builds ``!!binary aGk=`` as the bytes
``b"hi"``; a cost file's ``f: !!binary aGk=`` then read as the per-stage times ``[104, 105]`` (bytes are a
sequence of ints) and ``simulate`` ranked schedules on them -- a silent wrong result."""

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

CASES = [(kind, tag) for kind in INPUTS for tag in TAGGED]


@pytest.mark.parametrize("kind, tag", CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_tagged_value_refused(kind, tag, tmp_path):
    text, line, tagged, command = INPUTS[kind]
    assert line in text, f"{kind}: the example no longer holds {line!r}"
    path = tmp_path / "input.yaml"
    path.write_text(text.replace(line, tagged.format(TAGGED[tag]), 1))
    outcome = run_api(lambda: load_config(path, env={}).check()) if command is None else run_cli(command(path))
    refused(outcome, str(path), case=f"{kind} with a {tag} value")
