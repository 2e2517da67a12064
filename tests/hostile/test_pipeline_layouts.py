"""Megatron's ``pipeline_model_parallel_layout`` (``Et*16|t*16L``) whose repeats expand past any model -- a count of
eleven digits, repeats nested inside repeats, a count of 5000 digits -- or whose counts are not ASCII digits, through a
training YAML and a ``--megatron-config`` argument list. Each is one line naming the field, within a second; the
layouts they start from project.

Defects this family found (round ten): the repeats were expanded before anything was counted, so ``t*99999999999`` and
``(t*99999)*99999`` were MemoryError tracebacks (without a memory limit, gigabytes allocated first), ``()*3`` was a
TypeError, and ``t*١٦`` read as 16."""

from pathlib import Path

import pytest
import yaml

from hostile_support import accepted, refused, run_cli, small_gpt_arguments

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
HARDWARE = EXAMPLES / "hardware" / "h100.yaml"
LAYERS = 8
VALID = f"Et*{LAYERS // 2}|t*{LAYERS // 2}L"
LAYOUTS = {"count of 11 digits": "Et*99999999999|tL", "nested repeats": "E(t*99999)*99999|tL",
           "30 nested groups": "E" + "(" * 30 + "t" + ")*9" * 30 + "|tL",
           "count of 5000 digits": "Et*" + "9" * 5000 + "|tL",
           "count in Arabic-Indic digits": f"Et*{chr(0x660 + LAYERS // 2)}|t*{LAYERS // 2}L",
           "empty group": f"E()*3t*{LAYERS // 2}|t*{LAYERS // 2}L"}


def _training(tmp_path, layout: str) -> list:
    data = yaml.safe_load((EXAMPLES / "models" / "llama2-7b.yaml").read_text())
    data["num_layers"] = LAYERS
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    training = yaml.safe_load((EXAMPLES / "training" / "default.yaml").read_text())
    training.update(pipeline_model_parallel_size=2, pipeline_model_parallel_layout=layout)
    (tmp_path / "training.yaml").write_text(yaml.safe_dump(training))
    return ["--model", tmp_path / "model.yaml", "--training", tmp_path / "training.yaml"]


def _argument_list(tmp_path, layout: str) -> list:
    path = tmp_path / "args.sh"
    path.write_text(small_gpt_arguments(LAYERS, 2, f"--pipeline-model-parallel-layout '{layout}'"))
    return ["--megatron-config", path]


DOORS = {"training": _training, "megatron-config": _argument_list}


def _project(tmp_path, door: str, layout: str):
    return run_cli(["project", *DOORS[door](tmp_path, layout), "--hardware", HARDWARE, "-a", "1f1b", "--json"])


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("label", sorted(LAYOUTS))
def test_layouts_refused(tmp_path, door, label):
    refused(_project(tmp_path, door, LAYOUTS[label]), "pipeline_model_parallel_layout",
            case=f"project {door} layout {label}")


@pytest.mark.parametrize("door", sorted(DOORS))
def test_the_valid_layout_projects(tmp_path, door):
    accepted(_project(tmp_path, door, VALID), case=f"project {door} layout {VALID}")
