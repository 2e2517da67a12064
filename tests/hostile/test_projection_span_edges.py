"""``primuspipe project`` with hardware figures at the edges of their spans (``hardware_spec.SPANS``: what a
hardware file may give), alone and in pairs. Each edge is a figure the file accepts, yet a 1 GFLOP/s peak or a
1 MB/s HBM beside a 5 us link latency made times more than 1e9 apart, which the cost model refuses: every
candidate was refused in turn (a "not projected" list, no error line) -- 260 of the pairs below. The rule is
the projection's (``projected_or_named``): finite figures, or one line naming a field."""

import itertools
from pathlib import Path

import pytest
import yaml

from hostile_support import projected_or_named, run_cli
from primuspipe.projection.hardware_spec import SPANS

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
BASES = {
    "dense": {"model": EXAMPLES / "models" / "llama2-7b.yaml", "training": EXAMPLES / "training" / "default.yaml",
              "hardware": EXAMPLES / "hardware" / "h100.yaml"},
    "moe": {"model": EXAMPLES / "models" / "deepseek-v2-lite.yaml",
            "training": EXAMPLES / "training" / "mixtral-8x7b.yaml", "hardware": EXAMPLES / "hardware" / "mi355x.yaml"},
}
EDGES = [(name, value) for name, (low, high, _) in SPANS.items() for value in (low, high)]
PAIRS = [(a, b) for a, b in itertools.combinations(EDGES, 2) if a[0] != b[0]]


def _project(tmp_path, base: str, changes: dict):
    files = BASES[base]
    hardware = {**yaml.safe_load(files["hardware"].read_text()), **changes}
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(hardware))
    return run_cli(["project", "--model", files["model"], "--training", files["training"], "--hardware", path,
                    "-a", "1f1b", "--json"])


@pytest.mark.parametrize("base", sorted(BASES))
def test_each_figure_at_its_edges(tmp_path, base):
    for name, value in EDGES:
        projected_or_named(_project(tmp_path, base, {name: value}), f"project {base} {name}={value:g}", name)


@pytest.mark.parametrize("first", sorted({a[0] for a, _ in PAIRS}))
def test_two_figures_at_their_edges(tmp_path, first):
    """Every pair of edges, on the MoE model (whose dispatch and permutation figures count too)."""
    for (a, va), (b, vb) in PAIRS:
        if a == first:
            outcome = _project(tmp_path, "moe", {a: va, b: vb})
            projected_or_named(outcome, f"project moe {a}={va:g} {b}={vb:g}", a if a in outcome.message else b)
