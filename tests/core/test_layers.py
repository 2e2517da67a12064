"""The sub-packages are layers: each imports only the layers below it, so there is no import cycle, and
torch enters only in the runtime, the backends and the test harness (and the projection's layer benchmark,
which times real megatron-core layers) -- in no other module, not even inside a function."""

import ast
import functools
import json
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


FRAMEWORKS = {
    "torch": ("runtime", "backends", "testing", "projection.benchmark"),
    "megatron": ("backends.megatron", "testing.megatron", "projection.benchmark"),
    "transformer_engine": ("backends.megatron", "testing.megatron", "projection.benchmark"),
}
"""A framework -> the parts of primuspipe that may import it; everything else schedules, simulates and projects
without it (the import test below only sees what a module loads when imported, this table every import)."""


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "primuspipe" else None


def _modules() -> dict[str, Path]:
    return {".".join(("primuspipe", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): path
            for path in ROOT.rglob("*.py")}


@functools.cache
def _all_imports(top_level_only: bool = False) -> tuple[tuple[str, str, int], ...]:
    """Every ``(importing module, imported module, line)``, function-level imports included unless
    ``top_level_only`` (then what a module runs as it loads: its body and the ``try`` blocks in it, not an
    ``if TYPE_CHECKING:``). ``from a import b`` imports ``a.b`` where that is a module of primuspipe's. Parsed once
    a session (every module's source, the tests below read it four times)."""
    modules = _modules()
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        nodes = ast.walk(tree) if not top_level_only else \
            [n for top in tree.body for n in ([top] if not isinstance(top, ast.Try) else ast.walk(top))]
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [(module, f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module,
                           node.lineno) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(module, a.name, node.lineno) for a in node.names]
    return tuple(found)


def _imports() -> list[tuple[str, str, int]]:
    """Every ``(importing module, imported primuspipe module, line)``, function-level imports included."""
    return [(m, t, line) for m, t, line in _all_imports() if t.startswith("primuspipe.")]


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


def test_no_import_cycle_between_modules():
    """What modules import as they load never comes back to them (a cycle works or breaks by import order)."""
    graph = nx.DiGraph((m, t) for m, t, _ in _all_imports(top_level_only=True) if t.startswith("primuspipe."))
    assert nx.is_directed_acyclic_graph(graph), f"import cycles: {list(nx.simple_cycles(graph))[:5]}"


def test_frameworks_are_imported_only_where_they_may_be():
    def allowed(module: str, framework: str) -> bool:
        return any(module == f"primuspipe.{part}" or module.startswith(f"primuspipe.{part}.")
                   for part in FRAMEWORKS[framework])

    wrong = [f"{m}:{line} imports {t}" for m, t, line in _all_imports()
             if (framework := t.split(".")[0]) in FRAMEWORKS and not allowed(m, framework)]
    assert not wrong, "framework imports outside runtime/, backends/, testing/:\n" + "\n".join(wrong)


_PROBE = """import importlib, json, sys
for module in sys.argv[1:]:
    importlib.import_module(module)
    print(json.dumps([module, "torch" in sys.modules]), flush=True)
    if "torch" in sys.modules:
        break
"""


@functools.cache
def _loads_torch() -> dict[str, str]:
    """Per :data:`TORCH_FREE` module, what importing it in a fresh interpreter does: "" (torch stays out), "loads
    torch", or the error it fails with. The modules are imported one after another in one interpreter: what a module
    imports either was loaded by an earlier one (which did not load torch, or the run would have stopped there) or
    is loaded now, so torch is in ``sys.modules`` right after a module exactly when importing that module alone
    loads it. After a module that loads torch or fails, the rest start over in a fresh interpreter."""
    found: dict[str, str] = {}
    while left := [m for m in TORCH_FREE if m not in found]:
        done = subprocess.run([sys.executable, "-c", _PROBE, *left], capture_output=True, text=True)
        for line in done.stdout.splitlines():
            module, loaded = json.loads(line)
            found[module] = "loads torch" if loaded else ""
        if done.returncode:  # the first module it did not report failed to import
            found[next(m for m in left if m not in found)] = f"fails: {done.stderr.strip().splitlines()[-1:]}"
    return found


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_the_core_does_not_load_torch(module):
    assert not _loads_torch()[module], f"importing {module} {_loads_torch()[module]}"
