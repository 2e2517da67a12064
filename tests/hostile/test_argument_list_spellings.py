"""``project --megatron-config`` argument lists spelt every way a launch script can spell them, generated from one
base list: each flag in its ``=`` form, its Primus underscore form, repeated (argparse keeps the last, and so must
the projection), behind Windows line endings -- all read as Megatron reads them, checked value by value; and each
flag misspelt the ways argparse refuses: one hyphen, a typographic dash, ``--flag=`` with nothing after it, a shell
variable left unexpanded. Then the launcher's GPU counts and files that hold no argument list at all.

Defects this family found: ``-pipeline-model-parallel-size 4`` and ``\u2014pipeline-model-parallel-size 4`` were
read as a value of the flag before them (refused naming ``--bf16``; after a flag the projection does not read,
ignored, so the run was projected at pp 1); ``--num-layers=`` took the next flag as its value (``num_layers=True``);
``--nproc-per-node 0`` or ``-8`` was refused as a data-parallel size the user never wrote; a line-continued script
with CRLF line endings was refused over a stray ``\\r``; an empty file, a comment-only file, a launcher line alone or
a YAML list was refused as four missing fields."""

from pathlib import Path

import pytest

from hostile_support import accepted, record, refused, run_cli
from primuspipe.projection.megatron_args import read_megatron_config

HARDWARE = Path(__file__).parents[2] / "examples" / "projection" / "hardware" / "h100.yaml"
LAUNCHER = "torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py"
FLAGS = {"num-layers": "8", "hidden-size": "1024", "num-attention-heads": "16", "seq-length": "2048",
         "max-position-embeddings": "2048", "vocab-size": "32000", "micro-batch-size": "1", "global-batch-size": "64",
         "pipeline-model-parallel-size": "2"}
SWITCHES = ["--bf16", "--use-distributed-optimizer"]
FIELDS = {"num-layers": ("model", "num_layers"), "hidden-size": ("model", "hidden_size"),
          "num-attention-heads": ("model", "num_attention_heads"), "seq-length": ("model", "seq_length"),
          "max-position-embeddings": ("model", "max_position_embeddings"), "vocab-size": ("model", "vocab_size"),
          "micro-batch-size": ("training", "micro_batch_size"), "global-batch-size": ("training", "global_batch_size"),
          "pipeline-model-parallel-size": ("training", "pipeline_model_parallel_size")}
OTHER = {"num-layers": "16", "hidden-size": "2048", "num-attention-heads": "32", "seq-length": "1024",
         "max-position-embeddings": "4096", "vocab-size": "50304", "micro-batch-size": "2", "global-batch-size": "128",
         "pipeline-model-parallel-size": "4"}
"""A second valid value of each flag, for the repeated-flag spellings (the last one given must win)."""


def _tokens(flag: str, spelling: str) -> tuple[list[str], str]:
    """The flag's tokens in ``spelling`` and the value the projection must read from them."""
    value, other = FLAGS[flag], OTHER[flag]
    return {
        "plain": ([f"--{flag}", value], value),
        "equals": ([f"--{flag}={value}"], value),
        "primus underscores": ([f"--{flag.replace('-', '_')}", value], value),
        "repeated, same": ([f"--{flag}", value, f"--{flag}", value], value),
        "repeated, last wins": ([f"--{flag}", value, f"--{flag}", other], other),
        "repeated, equals last": ([f"--{flag}", value, f"--{flag}={other}"], other),
        "one hyphen": ([f"-{flag}", value], None),
        "em dash": ([f"\u2014{flag}", value], None),
        "en dash": ([f"\u2013{flag}", value], None),
        "minus sign": ([f"\u2212\u2212{flag}", value], None),
        "equals, nothing after": ([f"--{flag}=", value], None),
        "shell variable": ([f"--{flag}", "$VALUE"], None),
        "braced shell variable": ([f"--{flag}", "${VALUE}"], None),
        "shell default": ([f"--{flag}", f"${{VALUE:-{value}}}"], None),
    }[spelling]


VALID = ["plain", "equals", "primus underscores", "repeated, same", "repeated, last wins", "repeated, equals last"]
INVALID = ["one hyphen", "em dash", "en dash", "minus sign", "equals, nothing after", "shell variable",
           "braced shell variable", "shell default"]


def _script(flag: str, spelling: str, line_end: str = "\n") -> tuple[str, str | None]:
    """A launch script with ``flag`` spelt ``spelling`` at each position: first, between, last (the misspelt token
    must be refused wherever it stands, also right after a switch or a flag the projection does not read)."""
    tokens, value = _tokens(flag, spelling)
    rest = [t for name, v in FLAGS.items() if name != flag for t in (f"--{name}", v)]
    lines = [LAUNCHER, " ".join(SWITCHES[:1]), " ".join(tokens), "--lr 1e-4", " ".join(rest), SWITCHES[1]]
    return f" \\{line_end}".join(lines) + line_end, value


def _project(tmp_path, text: str):
    path = tmp_path / "args.sh"
    path.write_bytes(text.encode())
    return run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", "1f1b", "--json"]), path


@pytest.mark.parametrize("spelling", VALID)
@pytest.mark.parametrize("flag", sorted(FLAGS))
@pytest.mark.parametrize("line_end", ["\n", "\r\n"], ids=["LF", "CRLF"])
def test_valid_spellings_read_the_value_megatron_reads(tmp_path, flag, spelling, line_end):
    text, value = _script(flag, spelling, line_end)
    path = tmp_path / "args.sh"
    path.write_bytes(text.encode())
    case = f"megatron-config {spelling} --{flag} ({'CRLF' if line_end == chr(13) + chr(10) else 'LF'})"
    try:
        config = read_megatron_config(path)
    except Exception as exc:  # noqa: BLE001 - tallied as the valid input it refused
        record("refused", case)
        raise AssertionError(f"{case}: {exc}") from None
    spec, field = FIELDS[flag]
    got = getattr(config.model if spec == "model" else config.training, field)
    record("sound" if got == int(value) else "silent", case)
    assert got == int(value), f"{case}: read {field}={got}, Megatron reads {value}"


@pytest.mark.parametrize("flag", ["pipeline-model-parallel-size", "global-batch-size"])
def test_repeated_flags_project_the_last(tmp_path, flag):
    """Through the CLI: a script giving a flag twice projects what Megatron runs (the last)."""
    outcome, _ = _project(tmp_path, _script(flag, "repeated, last wins")[0])
    accepted(outcome, case=f"project --megatron-config --{flag} twice")


@pytest.mark.parametrize("spelling", INVALID)
@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_misspelt_flags_are_named(tmp_path, flag, spelling):
    outcome, _ = _project(tmp_path, _script(flag, spelling)[0])
    refused(outcome, flag, case=f"megatron-config {spelling} --{flag}")


@pytest.mark.parametrize("launcher, names", [
    ("--nnodes 1 --nproc-per-node 0", ["--nproc-per-node", ">= 1"]),
    ("--nnodes 1 --nproc-per-node -8", ["--nproc-per-node", ">= 1"]),
    ("--nnodes 0 --nproc-per-node 8", ["--nnodes", ">= 1"]),
    ("--nnodes -2 --nproc-per-node 8", ["--nnodes", ">= 1"]),
    ("--nnodes 1 --nproc-per-node 1e3", ["--nproc-per-node"]),
    ("--nnodes 1 --nproc-per-node 8.0", ["--nproc-per-node"]),
    ("--nnodes 1 --nproc-per-node 99999999999999999999", ["--nproc-per-node"]),
    ("--nnodes 1 --nproc-per-node=0", ["--nproc-per-node"]),
    ("--nnodes=0 --nproc_per_node=8", ["--nnodes"]),
])
def test_launcher_counts(tmp_path, launcher, names):
    text = _script("num-layers", "plain")[0].replace("--nnodes 1 --nproc-per-node 8", launcher)
    refused(_project(tmp_path, text)[0], *names, case=f"megatron-config launcher {launcher}")


@pytest.mark.parametrize("launcher, gpus", [("--nnodes 2 --nproc-per-node 4", 8), ("--nnodes=2 --nproc-per-node=4", 8),
                                            ("--nproc_per_node 4 --nnodes 2", 8),
                                            ("--nnodes 1 --nproc-per-node 8 --nnodes 2", 16)])
def test_launcher_spellings(tmp_path, launcher, gpus):
    """torchrun's spellings, its last --nnodes winning as in argparse."""
    path = tmp_path / "args.sh"
    path.write_text(_script("num-layers", "plain")[0].replace("--nnodes 1 --nproc-per-node 8", launcher))
    world = read_megatron_config(path).world_size
    record("sound" if world == gpus else "silent", f"megatron-config launcher {launcher}")
    assert world == gpus, f"{launcher}: {world} GPUs"


CONTENTS = {
    "empty": b"", "blank": b"  \n\t \n", "comments only": b"# set in the environment\n# --num-layers 32\n",
    "launcher alone": LAUNCHER.encode() + b"\n", "NUL bytes": b"\0" * 64,
    "YAML number": b"42\n", "YAML null": b"null\n", "a word": b"pretrain_gpt\n",
}


@pytest.mark.parametrize("name", sorted(CONTENTS))
def test_files_without_an_argument_list(tmp_path, name):
    outcome, path = _project(tmp_path, CONTENTS[name].decode())
    refused(outcome, str(path), "no Megatron arguments", case=f"megatron-config file: {name}")


@pytest.mark.parametrize("text", ["- --num-layers\n- 8\n", "- num_layers: 8\n", "[--num-layers, 8]\n"])
def test_yaml_lists(tmp_path, text):
    """A YAML list of arguments was read as an argument list whose dashes were values ('got -')."""
    outcome, path = _project(tmp_path, text)
    refused(outcome, str(path), "YAML list", case=f"megatron-config YAML list {text!r}")


@pytest.mark.parametrize("content", [b"\xff\xfe-\x00-\x00", "--num-layers 8".encode("utf-16"), bytes(range(256))])
def test_files_that_are_not_text(tmp_path, content):
    path = tmp_path / "args.sh"
    path.write_bytes(content)
    outcome = run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", "1f1b"])
    refused(outcome, str(path), "UTF-8", case=f"megatron-config not text {content[:6]!r}")


MEGATRON_SETTLES = {"recompute_activations", "use_rotary_position_embeddings"}
"""The switches megatron/training/arguments.py ``validate_args`` applies over their field after parsing (``if
args.recompute_activations: args.recompute_granularity = 'selective'``; "Legacy RoPE arguments")."""


def _alias_cases() -> list[tuple[str, str, str]]:
    """(switch alias, its field, a value of the field) for every switch that sets a field Megatron also has a flag
    for, over the field's every value (its Literal's; a true/false field has no flag taking a value)."""
    import typing

    from primuspipe.projection.megatron_flag_names import MEGATRON_FLAGS
    from primuspipe.projection.megatron_flags import ALIASES
    from primuspipe.projection.model_spec import ModelSpec
    from primuspipe.projection.training_spec import TrainingSpec

    hints = {**typing.get_type_hints(ModelSpec), **typing.get_type_hints(TrainingSpec)}
    cases = []
    for alias, (_, field, setting) in sorted(ALIASES.items()):
        if setting is None or field not in MEGATRON_FLAGS:
            continue
        literal = [k for k in (hints[field], *typing.get_args(hints[field])) if typing.get_origin(k) is typing.Literal]
        cases += [(alias, field, value) for kind in literal for value in typing.get_args(kind)]
    return cases


@pytest.mark.parametrize("alias, field, value", _alias_cases())
@pytest.mark.parametrize("order", ["switch first", "field first"])
def test_a_switch_and_its_fields_flag(tmp_path, alias, field, value, order):
    """``--recompute-activations --recompute-granularity full`` projected full or selective by which came last;
    Megatron's validate_args sets selective after parsing (and rope for --use-rotary-position-embeddings). Either
    order now gives Megatron's value, and a switch Megatron does not settle so is refused beside another value."""
    from primuspipe.projection.megatron_flags import ALIASES

    switch, flag = f"--{alias.replace('_', '-')}", f"--{field.replace('_', '-')} {value}"
    pair = f"{switch} {flag}" if order == "switch first" else f"{flag} {switch}"
    text = _script("num-layers", "plain")[0].replace("--lr 1e-4", pair)
    path = tmp_path / "args.sh"
    path.write_text(text)
    case = f"megatron-config {pair}"
    setting = ALIASES[alias][2]
    if alias not in MEGATRON_SETTLES and value not in (setting, "none"):
        refused(run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", "1f1b"]), switch,
                f"--{field.replace('_', '-')}", case=case)
        return
    try:
        config = read_megatron_config(path)
    except Exception as exc:  # noqa: BLE001 - a valid pair refused (full recompute wants its method, say)
        outcome = run_cli(["project", "--megatron-config", path, "--hardware", HARDWARE, "-a", "1f1b"])
        refused(outcome, case=case)
        assert field.split("_")[0] in str(exc), exc
        return
    got = getattr(config.training if hasattr(config.training, field) else config.model, field)
    record("sound" if got == setting else "silent", case)
    assert got == setting, f"{case}: {field}={got}, Megatron runs {setting}"
