"""The sub-packages are layers: each imports only the layers below it, so there is no import cycle, and
torch enters only in the runtime, the backends and the test harness."""

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import primuspipe

ROOT = Path(primuspipe.__file__).parent

LAYERS = {
    "errors": 0,
    "strict": 0,
    "documents": 0,
    "ir": 1,
    "io": 2,
    "passes": 3,
    "algorithms": 4,
    "simulator": 4,
    "search": 5,
    "calibration": 5,
    "runtime": 5,
    "tools": 6,
    "projection": 6,
    "backends": 6,
    "cli": 7,
    "__main__": 7,  # python -m primuspipe: the command
    "testing": 8,
}
"""Sub-package -> layer; a module may import its own sub-package and any lower layer."""

TORCH_FREE = ["primuspipe.strict", "primuspipe.ir", "primuspipe.io", "primuspipe.passes", "primuspipe.algorithms", "primuspipe.simulator",
              "primuspipe.search", "primuspipe.calibration", "primuspipe.runtime.runner", "primuspipe.runtime.driver",
              "primuspipe.tools.pp_vis", "primuspipe.projection", "primuspipe.projection.projection", "primuspipe.cli"]


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "primuspipe" else None


def _imports() -> list[tuple[str, str, int]]:
    """Every ``(importing module, imported primuspipe module, line)``, function-level imports included."""
    found = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(("primuspipe", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [(module, f"{node.module}.{a.name}" if node.module == "primuspipe" else node.module, node.lineno)
                          for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(module, a.name, node.lineno) for a in node.names]
    return [(m, t, line) for m, t, line in found if t.startswith("primuspipe.")]


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    assert packages | modules <= set(LAYERS), f"give these a layer: {sorted(packages | modules - set(LAYERS))}"


def test_imports_go_down_the_layers_only():
    upward = [f"{m}:{line} imports {t}" for m, t, line in _imports()
              if LAYERS[_subpackage(t)] > LAYERS[_subpackage(m)]]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_no_import_cycle_between_subpackages():
    graph = nx.DiGraph((_subpackage(m), _subpackage(t)) for m, t, _ in _imports() if _subpackage(m) != _subpackage(t))
    assert nx.is_directed_acyclic_graph(graph), f"import cycles: {list(nx.simple_cycles(graph))}"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_the_core_does_not_load_torch(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"importing {module} loads torch"
