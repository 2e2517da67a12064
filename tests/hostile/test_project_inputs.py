"""``primuspipe project``: numbers on its command line and in its YAML inputs are strict too, a YAML
alias bomb is refused unexpanded, and its report is plain text (no markup shown or eaten)."""

from pathlib import Path

import pytest

from hostile_support import projected_or_named, refused, run_cli

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
BASE = ["project", "--model", EXAMPLES / "models" / "llama2-7b.yaml", "--hardware", EXAMPLES / "hardware" / "h100.yaml",
        "-a", "1f1b"]
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9))


@pytest.mark.parametrize("flag, value", [("--pp", "４"), ("--pp", "0"), ("--vpp", "2.5"), ("--micro-batch-size", "-1"),
                                         ("--target-nodes", "inf"), ("--top", "-1"), ("--risk-margin", "nan"),
                                         ("--benchmark-ranks", "true")])
def test_command_line(flag, value):
    refused(run_cli([*BASE, flag, value]), flag, case=f"project {flag} {value}")


@pytest.mark.parametrize("field, value", [("peak_bf16_tflops", ".nan"), ("gpus_per_node", "８"),
                                          ("hbm_bytes", "-1"), ("achievable_fraction", ".inf")])
def test_hardware_file(tmp_path, field, value):
    text = (EXAMPLES / "hardware" / "h100.yaml").read_text()
    lines = [f"{field}: {value}" if line.startswith(f"{field}:") else line for line in text.splitlines()]
    path = tmp_path / "hw.yaml"
    path.write_text("\n".join(lines) + "\n")
    refused(run_cli([*BASE[:3], "--hardware", path, "-a", "1f1b"]), field, case=f"project hardware {field}={value}")


def test_yaml_bomb(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    refused(run_cli(["project", "--model", path, "--hardware", EXAMPLES / "hardware" / "h100.yaml"]), "aliases",
            case="project model YAML bomb")


def test_report_is_plain_text():
    outcome = run_cli([*BASE, "--pp", "8"])
    assert outcome.code == 0, outcome.err
    assert "[/]" not in outcome.out and "[bold" not in outcome.out and "[yellow]" not in outcome.out


@pytest.mark.parametrize("nodes", ["16", "32", "64"])
def test_search_with_more_replicas_than_samples(nodes):
    """Round ten: ``--search`` at a GPU count where a pp leaves more data-parallel replicas than the global batch has
    samples (128 at pp 1 from 16 nodes of 8) was a ZeroDivisionError; such splits are no candidates."""
    projected_or_named(run_cli([*BASE, "--search", "--target-nodes", nodes, "--json"]),
                       f"project --search --target-nodes {nodes} (GBS 128)", "global_batch_size")
