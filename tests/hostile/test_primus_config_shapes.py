"""Primus YAML configurations for ``project --megatron-config`` whose shape is wrong somewhere, generated place by
place: keys that YAML reads as numbers, booleans or null (``1:``, ``true:``, ``null:``) at the top, in a module's
overrides, in the model file and in its base; a module, its ``overrides`` or a model file's ``bases`` of another type
(a list, a text, a number, a boolean); Megatron's switches (``bf16``, ``disable_bias_linear``, ...) given text or
numbers. Each is one line naming the file and the key.

Defects this family found: a non-text key was an AttributeError traceback (``'int' object has no attribute
'startswith'``), and ``bases: 5`` a TypeError; a module or its overrides that were not a mapping were skipped, so
the run was projected without them (``overrides: [pipeline_model_parallel_size, 2]`` projected pp 1); ``bf16: 'no'``
switched bf16 on (any non-empty text is true to the alias)."""

import pytest

from hostile_support import accepted, refused, run_cli
from primuspipe.projection.megatron_args import read_megatron_config
from primuspipe.projection.megatron_flags import ALIASES
from pathlib import Path

HARDWARE = Path(__file__).parents[2] / "examples" / "projection" / "hardware" / "h100.yaml"
BASE = "num_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nmax_position_embeddings: 32\n"
MODEL = "bases: [base.yaml]\nvocab_size: 100\n"
CONFIG = "modules:\n  pre_trainer:\n    framework: megatron\n    model: model.yaml\n    overrides:\n" \
         "      global_batch_size: 8\n      pipeline_model_parallel_size: 2\n"
KEYS = {"integer": "1", "boolean": "true", "null": "null", "float": "1.5", "yes": "yes"}
PLACES = ["configuration", "overrides", "model file", "base file"]
"""Where the key stands: a flat configuration's top (a Primus experiment's top keys beside ``modules`` -- its
``work_group``, ``exp_name`` -- are not Megatron's and not read), a module's overrides, the model file, its base."""


def _files(tmp_path, config=CONFIG, model=MODEL, base=BASE):
    for name, text in (("config.yaml", config), ("model.yaml", model), ("base.yaml", base)):
        (tmp_path / name).write_text(text)
    return tmp_path / "config.yaml"


def _project(path):
    return run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "--target-nodes", "1",
                    "--micro-batch-size", "1", "-a", "1f1b", "--json"])


def test_the_base_configuration_projects(tmp_path):
    path = _files(tmp_path)
    accepted(_project(path), case="primus config base")
    assert read_megatron_config(path).training.pipeline_model_parallel_size == 2


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("key", sorted(KEYS))
def test_keys_that_are_not_names(tmp_path, key, place):
    line = f"{KEYS[key]}: 2"
    files = {"configuration": dict(config=BASE + "vocab_size: 100\nglobal_batch_size: 8\n" + line + "\n"),
             "overrides": dict(config=CONFIG + f"      {line}\n"),
             "model file": dict(model=MODEL + line + "\n"), "base file": dict(base=BASE + line + "\n")}[place]
    outcome = _project(_files(tmp_path, **files))
    refused(outcome, "config.yaml", "no argument name", case=f"primus {key} key in the {place}")


WRONG = {"list": "[pipeline_model_parallel_size, 2]", "text": "'pipeline_model_parallel_size: 2'", "number": "2",
         "boolean": "true"}


@pytest.mark.parametrize("value", sorted(WRONG))
@pytest.mark.parametrize("place", ["module", "overrides", "bases"])
def test_values_of_the_wrong_type(tmp_path, place, value):
    if place == "module":
        files = dict(config=CONFIG + f"  post_trainer: {WRONG[value]}\n")
        names = ["modules.post_trainer", "mapping"]
    elif place == "overrides":
        files = dict(config=CONFIG.split("    overrides:")[0] + f"    overrides: {WRONG[value]}\n")
        names = ["modules.pre_trainer.overrides", "mapping"]
    else:
        files = dict(model=f"bases: {WRONG[value]}\nvocab_size: 100\n" + BASE)
        names = ["model.yaml", "bases"]
    if (place, value) == ("bases", "text"):  # one base's name, of no file
        names = ["model.yaml", "not found"]
    refused(_project(_files(tmp_path, **files)), *names, case=f"primus {place}: {value}")


SWITCHES = sorted(name for name, (_, _, setting) in ALIASES.items() if setting is not None)


@pytest.mark.parametrize("value", ["'no'", "'false'", "'0'", "off_", "1", "0", "[true]"])
@pytest.mark.parametrize("switch", SWITCHES)
def test_switches_given_text_or_numbers(tmp_path, switch, value):
    outcome = _project(_files(tmp_path, config=CONFIG + f"      {switch}: {value}\n"))
    refused(outcome, switch, "switch", case=f"primus {switch}: {value}")


@pytest.mark.parametrize("value", ["true", "false", "null"])
def test_switches_given_a_boolean(tmp_path, value):
    path = _files(tmp_path, config=CONFIG + f"      bf16: {value}\n")
    accepted(_project(path), case=f"primus bf16: {value}")
    assert read_megatron_config(path).training.precision == ("bf16" if value == "true" else "fp32")
