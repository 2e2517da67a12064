"""Primus-style ``--megatron-config`` files whose module ``model:`` file names ``bases:`` that loop, fan out,
nest deep or point nowhere. A fan-out (each of 8 files naming the next one 12 times) was read 12^7 times --
a hang; a loop is now named as one, a diamond read once per file."""

import pytest

from hostile_support import accepted, refused, run_cli
from pathlib import Path

HARDWARE = Path(__file__).parents[2] / "examples" / "projection" / "hardware" / "h100.yaml"
OVERRIDES = ("{hidden_size: 64, num_attention_heads: 4, seq_length: 32, max_position_embeddings: 32, vocab_size: 100, "
             "global_batch_size: 8}")


def _graph(kind: str, n: int) -> dict[str, list[str]]:
    """Model files ``f0 .. f{n-1}`` and the bases each names."""
    if kind == "loop":  # f0 -> f1 -> ... -> f{n-1} -> f0
        return {f"f{i}": [f"f{(i + 1) % n}"] for i in range(n)}
    if kind == "fan-out":  # each names the next one 12 times
        return {f"f{i}": [f"f{i + 1}"] * 12 for i in range(n - 1)} | {f"f{n - 1}": []}
    if kind == "diamond":  # each names both of the next level's files
        return {f"f{i}": [f"f{i + 1}", f"f{i + 1}b"] for i in range(n - 1)} | {
            f"f{i}b": [f"f{i + 1}"] for i in range(1, n - 1)} | {f"f{n - 1}": [], f"f{n - 1}b": []}
    if kind == "chain":
        return {f"f{i}": [f"f{i + 1}"] for i in range(n - 1)} | {f"f{n - 1}": []}
    return {"f0": ["nowhere"]}


@pytest.mark.parametrize("kind, n", [("loop", 1), ("loop", 2), ("loop", 3), ("loop", 7), ("fan-out", 4),
                                     ("fan-out", 8), ("diamond", 4), ("diamond", 8), ("chain", 9), ("chain", 10),
                                     ("chain", 12), ("missing", 1)])
def test_model_bases(tmp_path, kind, n):
    for name, bases in _graph(kind, n).items():
        text = (f"bases: [{', '.join(b + '.yaml' for b in bases)}]\n" if bases else "") + "num_layers: 4\n"
        (tmp_path / f"{name}.yaml").write_text(text)
    config = tmp_path / "config.yaml"
    config.write_text(f"modules:\n  pre_trainer:\n    framework: megatron\n    model: f0.yaml\n"
                      f"    overrides: {OVERRIDES}\n")
    outcome = run_cli(["project", "--megatron-config", config, "--hardware", HARDWARE, "--target-nodes", "1",
                       "--micro-batch-size", "1", "-a", "1f1b"])
    case = f"megatron-config model bases {kind} of {n}"
    if kind == "loop":
        refused(outcome, "loop", f"f{n - 1}.yaml -> f0.yaml", case=case)
    elif kind == "missing":
        refused(outcome, "nowhere", "not found", case=case)
    elif n > 9:
        refused(outcome, "deep", case=case)
    else:
        accepted(outcome, case=case)
