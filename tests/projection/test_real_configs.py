"""--megatron-config on real public launch configurations (tests/fixtures/real_configs, each file naming its
source and commit; SOURCES.yaml says how each is read and what is expected): each projects on the hardware its
source names, or is refused in one line that names the argument and why. Megatron-LM's launch scripts are run
by bash with the launcher stubbed to print what the script launches; its CI test cases' MODEL_ARGS become the
argument list as its CI builds it; Primus's experiment files are read as they are, model files and all."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from primuspipe.cli import main
from primuspipe.errors import PrimusPipeError
from primuspipe.projection.megatron_args import read_megatron_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
HARDWARE = Path(__file__).resolve().parents[2] / "examples" / "projection" / "hardware"
CASES = yaml.safe_load((FIXTURES / "SOURCES.yaml").read_text())["fixtures"]
LAUNCHERS = ("torchrun", "python", "uv")


def launched_arguments(script: Path, script_args: list[str], workdir: Path, environment: dict) -> str:
    """The argument list a launch script runs: bash runs it in ``workdir`` with torchrun (and python, uv) printing
    their arguments, shell-quoted, in place of starting anything."""
    stubs = workdir / "bin"
    stubs.mkdir()
    for name in LAUNCHERS:
        (stubs / name).write_text(f'#!/bin/bash\nprintf "%q " {name} "$@" > "$LAUNCHED"\n')
        (stubs / name).chmod(0o755)
    (workdir / "pretrain_gpt.py").write_text("")
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "LAUNCHED": str(workdir / "launched"), "HOME": str(workdir), "USE_UV": "0",
           **environment}
    subprocess.run(["bash", str(script), *script_args], cwd=workdir, env=env, check=True, capture_output=True,
                   timeout=60)
    return (workdir / "launched").read_text()


def ci_arguments(test_case: Path) -> str:
    """A Megatron-LM CI case's MODEL_ARGS as its CI passes them (shell_test_utils/_run_training.sh): ``true`` is the
    flag alone, ``""`` is dropped, ``"[a b]"`` is its words, anything else one value."""
    tokens = []
    for key, value in yaml.safe_load(test_case.read_text())["MODEL_ARGS"].items():
        if value is True:
            tokens.append(key)
        elif isinstance(value, str) and re.fullmatch(r"\[[^]]+\]", value):
            tokens += [key, *value[1:-1].split()]
        elif value != "" and value is not None:
            tokens += [key, *map(str, value)] if isinstance(value, list) else [key, str(value)]
    return shlex.join(tokens)


def config_file(case: dict, tmp_path: Path, vocab_size: int | None = None) -> Path:
    """The file --megatron-config is given for ``case`` (with ``--vocab-size`` added when asked)."""
    source = FIXTURES / case["file"]
    if source.suffix == ".sh" or "test_cases" in source.parts:
        text = (launched_arguments(source, case.get("script_args", []), tmp_path, case.get("env", {})) if source.suffix == ".sh"
                else ci_arguments(source))
        path = tmp_path / "arguments.txt"
        path.write_text(text + (f" --vocab-size {vocab_size}" if vocab_size else ""))
        return path
    tree = tmp_path / "primus"
    shutil.copytree(FIXTURES / "primus", tree)
    path = tree / source.relative_to(FIXTURES / "primus")
    if vocab_size:
        data = yaml.safe_load(path.read_text())
        next(iter(data["modules"].values()))["overrides"]["vocab_size"] = vocab_size
        path.write_text(yaml.safe_dump(data))
    return path


def project(case: dict, path: Path, capsys) -> tuple[int, str]:
    try:  # the schedule Megatron runs: interleaved with virtual stages (a refusal is the CLI's to show)
        vpp = read_megatron_config(path).training.virtual_pipeline_model_parallel_size
    except PrimusPipeError:
        vpp = None
    algorithm = "interleaved-1f1b" if (vpp or 1) > 1 else "1f1b"
    argv = ["project", "--megatron-config", str(path), "--hardware", str(HARDWARE / f"{case['hardware']}.yaml"),
            "-a", algorithm, "--json"] + (["--target-nodes", str(case["nodes"])] if "nodes" in case else [])
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def refusal(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="the launch scripts need bash")
@pytest.mark.parametrize("case", CASES, ids=[c["file"].rsplit("/", 1)[-1] for c in CASES])
def test_a_real_configuration_projects_or_is_refused_in_one_line(case, tmp_path, capsys):
    expect = case["expect"] if isinstance(case["expect"], dict) else {}
    code, err = project(case, config_file(case, tmp_path), capsys)
    if "vocab_size" in expect:  # refused naming the tokenizer, then read with its size
        assert code != 0 and "no --vocab-size: Megatron reads it from the tokenizer" in refusal(err), err
        retry = tmp_path / "with_vocabulary"
        retry.mkdir()
        code, err = project(case, config_file(case, retry, expect["vocab_size"]), capsys)
    if "refused" in expect:
        assert code != 0 and re.search(expect["refused"], refusal(err)), err
    else:
        assert code == 0, err


def test_the_fixtures_name_their_source_and_every_one_is_listed():
    listed = {case["file"] for case in CASES}
    for path in FIXTURES.rglob("*"):
        if path.is_file() and path.name != "SOURCES.yaml":
            head = path.read_text().splitlines()[:3]
            assert any(re.match(r"# Source: https://github\.com/\S+/blob/[0-9a-f]{40}/", line) for line in head), path
            relative = str(path.relative_to(FIXTURES))
            assert relative in listed or "/configs/models/" in relative, relative


def test_primus_model_files_are_followed_through_extends_in_primus_own_layout(tmp_path):
    """Primus's model files extend one another (``extends:``, not ``bases:``) from primus/configs/models/megatron
    beside examples/; its module's trainer defaults (bf16, the distributed optimizer) hold where the experiment
    leaves them."""
    case = {"file": "primus/examples/megatron/configs/MI300X/mixtral_8x7B_v0.1-BF16-pretrain.yaml"}
    config = read_megatron_config(config_file(case, tmp_path, vocab_size=32000))
    model, training = config.model, config.training
    assert (model.num_layers, model.hidden_size, model.num_experts, model.swiglu) == (32, 4096, 8, True)
    assert training.precision == "bf16" and training.use_distributed_optimizer
