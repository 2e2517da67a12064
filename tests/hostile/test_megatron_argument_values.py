"""``--megatron-config`` argument lists read as Megatron's ``argparse`` reads them. Their values were read as
YAML scalars: ``--num-layers 0x20`` projected 32 layers, ``--num-layers 1e3`` a string that later read as 1000,
``--bf16 no`` switched bf16 off (Megatron refuses all three), ``--hidden-dropout .inf`` was infinite. Each is now
one line naming the flag; what argparse accepts still projects. Primus YAML configurations keep YAML's reading
(they are YAML), and a configuration whose modules name two models is refused naming both."""

from pathlib import Path

import pytest

from hostile_support import accepted, refused, run_cli

HARDWARE = Path(__file__).parents[2] / "examples" / "projection" / "hardware" / "h100.yaml"
ARGS = {"num-layers": "8", "hidden-size": "1024", "num-attention-heads": "16", "seq-length": "2048",
        "max-position-embeddings": "2048", "vocab-size": "32000", "micro-batch-size": "1", "global-batch-size": "64",
        "pipeline-model-parallel-size": "2"}
INTS = ["num-layers", "hidden-size", "num-attention-heads", "seq-length", "micro-batch-size", "global-batch-size",
        "pipeline-model-parallel-size", "vocab-size"]
BAD_INTS = ["0x20", "0o10", "0b100", "1e3", "8.0", ".inf", "inf", "nan", "null", "~", "yes", "true", "８", "eight"]
FLOATS = ["hidden-dropout", "attention-dropout"]
BAD_FLOATS = [".inf", "inf", "-inf", "nan", ".nan", "1e999", "0x1", "yes", "null"]
SWITCHES = ["bf16", "use-distributed-optimizer", "sequence-parallel", "overlap-grad-reduce"]
BAD_SWITCH_VALUES = ["no", "false", "0", "off", "yes", "true", "1"]


def _project(tmp_path, args: dict[str, str], *switches: str):
    text = "torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py " + " ".join(
        f"--{k} {v}" for k, v in args.items()) + " " + " ".join(switches)
    path = tmp_path / "args.sh"
    path.write_text(text)
    return run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", "1f1b", "--json"])


@pytest.mark.parametrize("flag", INTS)
@pytest.mark.parametrize("value", BAD_INTS)
def test_integers_argparse_refuses(tmp_path, flag, value):
    refused(_project(tmp_path, {**ARGS, flag: value}, "--bf16"), f"--{flag}",
            case=f"megatron-config --{flag} {value}")


@pytest.mark.parametrize("flag", FLOATS)
@pytest.mark.parametrize("value", BAD_FLOATS)
def test_numbers_that_are_not_finite(tmp_path, flag, value):
    refused(_project(tmp_path, {**ARGS, flag: value}, "--bf16"), f"--{flag}", case=f"megatron-config --{flag} {value}")


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("value", BAD_SWITCH_VALUES)
def test_switches_take_no_value(tmp_path, switch, value):
    refused(_project(tmp_path, ARGS, "--bf16" if switch != "bf16" else "", f"--{switch} {value}"), f"--{switch}",
            case=f"megatron-config --{switch} {value}")


@pytest.mark.parametrize("edit", [{"hidden-dropout": "1e-1"}, {"hidden-dropout": "0"}, {"num-layers": "+8"},
                                  {"recompute-granularity": "selective", "recompute-modules": "core_attn"},
                                  {"recompute-granularity": "selective", "recompute-modules": "core_attn mlp"}])
def test_what_argparse_accepts_still_projects(tmp_path, edit):
    accepted(_project(tmp_path, {**ARGS, **edit}, "--bf16", "--use-distributed-optimizer"),
             case=f"megatron-config {edit}")


MODEL = "num_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nmax_position_embeddings: 32\n" \
        "vocab_size: 100\n"


@pytest.mark.parametrize("models", [["a", "b"], ["a", "a"], ["a", "b", "c"], ["a", None], ["a", "b", None]])
def test_modules_naming_several_models(tmp_path, models):
    """Two modules each naming a ``model:`` -- the last silently won."""
    for name in {m for m in models if m}:
        (tmp_path / f"{name}.yaml").write_text(MODEL)
    modules = "".join(f"  m{i}:\n    framework: megatron\n" + (f"    model: {m}.yaml\n" if m else "")
                      + "    overrides: {global_batch_size: 8}\n" for i, m in enumerate(models))
    config = tmp_path / "config.yaml"
    config.write_text("modules:\n" + modules)
    outcome = run_cli(["project", "--megatron-config", config, "--hardware", HARDWARE, "--target-nodes", "1",
                       "--micro-batch-size", "1", "-a", "1f1b"])
    case = f"megatron-config modules naming models {models}"
    named = [f"m{i}" for i, m in enumerate(models) if m]
    if len(named) > 1:
        refused(outcome, *named, case=case)
    else:
        accepted(outcome, case=case)
