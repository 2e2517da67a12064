"""``primuspipe project --megatron-config``: argument lists a launch script could hold that Megatron itself
refuses -- the virtual pipeline size set two ways or by a per-stage count that does not divide a stage,
both --bf16 and --fp16, a learned position table shorter than the sequence -- and lists a shell could not
split. Each is one clear line naming the flag (they were projected, or a traceback)."""

import json
from pathlib import Path

import pytest

from hostile_support import accepted, refused, run_cli, small_gpt_arguments

HARDWARE = Path(__file__).parents[2] / "examples" / "projection" / "hardware" / "h100.yaml"


def _base(layers: int, pp: int) -> str:
    return small_gpt_arguments(layers, pp, "--use-distributed-optimizer ")


def _project(tmp_path, text: str, algorithm: str = "1f1b"):
    path = tmp_path / "args.sh"
    path.write_text(text)
    return run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", algorithm, "--json"])


@pytest.mark.parametrize("layers, pp", [(24, 4), (32, 4), (30, 2)])
@pytest.mark.parametrize("per_stage", [1, 2, 3, 4, 5, 8, 16])
def test_layers_per_virtual_stage(tmp_path, layers, pp, per_stage):
    """Megatron asserts the layers per virtual stage divide a stage's layers; the projection floored
    ``layers / (pp * per_stage)`` into a vpp of another model (or 0)."""
    text = _base(layers, pp) + f"--num-layers-per-virtual-pipeline-stage {per_stage}"
    case = f"megatron-config {layers} layers pp {pp} --num-layers-per-virtual-pipeline-stage {per_stage}"
    outcome = _project(tmp_path, text, "interleaved-1f1b")
    stage = layers // pp
    if stage % per_stage:
        refused(outcome, "--num-layers-per-virtual-pipeline-stage", case=case)
        return
    accepted(outcome, case=case)
    if stage > per_stage:  # vpp 1 leaves an interleaved table its own default
        assert {row["vpp"] for row in json.loads(outcome.out)["results"]} == {stage // per_stage}


@pytest.mark.parametrize("per_stage, stages", [(2, 2), (4, 2), (1, 8)])
def test_virtual_pipeline_set_twice(tmp_path, per_stage, stages):
    """Both flags (agreeing or not): Megatron refuses both; the per-stage count won silently."""
    text = _base(32, 4) + (f"--num-layers-per-virtual-pipeline-stage {per_stage} "
                                           f"--num-virtual-stages-per-pipeline-rank {stages}")
    refused(_project(tmp_path, text), "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank", case=f"megatron-config vpp two ways {per_stage}/{stages}")


@pytest.mark.parametrize("tail", ["--lr '1e-4", '--lr "1e-4', "--data-path 'a b", "--lr 1e-4 '", '--tokenizer-type "'])
def test_unsplittable_argument_lists(tmp_path, tail):
    """An unclosed quote was a ValueError traceback out of shlex."""
    refused(_project(tmp_path, _base(8, 2) + tail), "args.sh", "quot",
            case=f"megatron-config unclosed quote {tail!r}")


@pytest.mark.parametrize("flags", ["--fp16", "--fp16 --fp8-format hybrid", "--fp16 --bf16"])
def test_two_precisions(tmp_path, flags):
    refused(_project(tmp_path, _base(8, 2) + flags), "--bf16", "--fp16",
            case=f"megatron-config --bf16 {flags}")


@pytest.mark.parametrize("positions", [512, 2047, 2048, 4096])
@pytest.mark.parametrize("embedding", ["", "--position-embedding-type rope"])
def test_position_table_shorter_than_the_sequence(tmp_path, positions, embedding):
    text = _base(8, 2).replace("--max-position-embeddings 2048",
                                                f"--max-position-embeddings {positions}")
    outcome = _project(tmp_path, text + embedding)
    case = f"megatron-config --max-position-embeddings {positions} {embedding}"
    if positions < 2048 and not embedding:
        refused(outcome, "max_position_embeddings", case=case)
    else:
        accepted(outcome, case=case)


YAML_VALUES = {"unclosed list": "'[1'", "alias": "'&a [*a]'", "python tag": "'!!python/name:os.getcwd'",
               "binary tag": "'!!binary aGk='", "key twice": "'{a: 1, a: 2}'", "octal": "010", "base 60": "1:30",
               "int tag on text": "'!!int x'", "timestamp tag on text": "'!!timestamp x'",
               "integer of 5000 digits": "9" * 5000}
"""Values Primus reads as YAML scalars, as a shell passes them (quoted where a shell would need it)."""
PRIMUS_CONFIG = ("modules:\n  pre_trainer:\n    framework: megatron\n    overrides:\n      num_layers: 8\n"
                 "      hidden_size: 1024\n      num_attention_heads: 16\n      seq_length: 2048\n"
                 "      max_position_embeddings: 2048\n      vocab_size: 32000\n      micro_batch_size: 1\n"
                 "      global_batch_size: {value}\n      pipeline_model_parallel_size: 2\n")


@pytest.mark.parametrize("door", ["--name_with_underscores value", "${VAR:default}"])
@pytest.mark.parametrize("label", sorted(YAML_VALUES))
def test_values_read_as_yaml(tmp_path, door, label):
    """Round ten: Primus's override style (``--num_layers 8``) and a ``${VAR:default}`` read their value with PyYAML's
    loose loader -- an unclosed ``[`` or a ``!!python`` tag was a traceback, an alias built a list that holds itself,
    ``010`` projected 8 layers and ``1:30`` 90. Both now read it as the files are read, naming the file."""
    value = YAML_VALUES[label]
    if door.startswith("--"):
        outcome = _project(tmp_path, _base(8, 2) + f"--global_batch_size {value}")
        names = ("args.sh", "global_batch_size")
    else:
        path = tmp_path / "primus.yaml"
        path.write_text(PRIMUS_CONFIG.format(value="'${GBS:%s}'" % value.strip("'").replace("'", "''")))
        outcome = run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "--target-nodes", "1",
                           "-a", "1f1b", "--json"])
        names = ("primus.yaml", "global_batch_size")
    refused(outcome, *names, case=f"megatron-config {door} {label}")


@pytest.mark.parametrize("fault, edit", [("octal", lambda t: t.replace("{value}", "010")),
                                         ("alias", lambda t: t.replace("{value}", "*gbs")),
                                         ("key twice", lambda t: t.replace("{value}", "8") + "      num_layers: 4\n"),
                                         ("tab indent", lambda t: t.replace("{value}", "8\n\t")),
                                         ("int tag on text", lambda t: t.replace("{value}", "!!int x"))])
def test_primus_yaml_refused_for_its_yaml(tmp_path, fault, edit):
    """Round ten: a Primus YAML the strict loader refuses was read as an argument list and refused as holding "no
    Megatron arguments" -- naming nothing the user got wrong. The YAML fault is named with its line."""
    path = tmp_path / "primus.yaml"
    path.write_text(edit(PRIMUS_CONFIG))
    refused(run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", "1f1b", "--json"]),
            "primus.yaml", "not valid YAML at line", case=f"megatron-config Primus YAML with {fault}")
