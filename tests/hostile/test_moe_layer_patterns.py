"""Megatron's string form of ``moe_layer_freq`` -- a sum of ``[bits]*count`` terms, ``([0]*3+[1]*58)`` -- whose
counts are far past the model's layers, in the first, a middle or the last term, through a model YAML and through a
``--megatron-config`` argument list; and the edges beside them (a pattern of exactly the layers, too short by one).
Each is a projection or one line naming ``moe_layer_freq``.

Defects this family found: the pattern was expanded before its length was compared with ``num_layers``, so
``[1]*10000000000`` was a MemoryError traceback (and ``[0]*100000000`` took a second and 800 MB to refuse); a count
of 5000 digits was int()'s ValueError and ``[1]*٧`` (Arabic-Indic digits, which Megatron's eval refuses) was 7.
"""

from pathlib import Path

import pytest
import yaml

from hostile_support import accepted, refused, run_cli, small_gpt_arguments

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
LAYERS = 8
COUNTS = [10**8, 10**10, 10**18, 10**30]
"""Past any layer count: a list that would not fit in memory from 10**10 on."""


def _patterns():
    for count in COUNTS:
        yield f"first term *{count:g}", f"([1]*{count}+[0]*1)"
        yield f"middle term *{count:g}", f"([1]*1+[0,1]*{count}+[1]*1)"
        yield f"last term *{count:g}", f"[1]*{LAYERS - 1}+[1]*{count}"
    yield "one entry short", f"([0]*1+[1]*{LAYERS - 2})"
    yield "one entry over", f"([0]*1+[1]*{LAYERS})"
    yield "count in Arabic-Indic digits", f"([0]*1+[1]*{chr(0x660 + LAYERS - 1)})"  # Megatron's eval: a SyntaxError
    yield "count of 5000 digits", "[1]*" + "9" * 5000


PATTERNS = list(_patterns())


def _model_yaml(tmp_path, pattern: str) -> Path:
    data = yaml.safe_load((EXAMPLES / "models" / "mixtral-8x7b.yaml").read_text())
    data.update(num_layers=LAYERS, moe_layer_freq=pattern)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _argument_list(tmp_path, pattern: str) -> Path:
    path = tmp_path / "args.sh"
    path.write_text(small_gpt_arguments(LAYERS, 2,
                                        f"--num-experts 8 --moe-router-topk 2 --moe-layer-freq '{pattern}'"))
    return path


def _project(tmp_path, door: str, pattern: str):
    inputs = ["--model", _model_yaml(tmp_path, pattern)] if door == "model" else \
        ["--megatron-config", _argument_list(tmp_path, pattern)]
    return run_cli(["project", *inputs, "--hardware", EXAMPLES / "hardware" / "h100.yaml", "-a", "1f1b", "--json"])


@pytest.mark.parametrize("door", ["model", "megatron-config"])
@pytest.mark.parametrize("label, pattern", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_patterns_past_the_layers(tmp_path, door, label, pattern):
    refused(_project(tmp_path, door, pattern), "moe_layer_freq", case=f"project {door} moe_layer_freq {label}")


@pytest.mark.parametrize("door", ["model", "megatron-config"])
def test_a_pattern_of_exactly_the_layers_projects(tmp_path, door):
    accepted(_project(tmp_path, door, f"([0]*1+[1]*{LAYERS - 1})"), case=f"project {door} moe_layer_freq exact")
