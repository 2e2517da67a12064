"""Code rules a reader cannot keep by eye across the package, checked on its source: every module says what it
is for, no catch-all handler swallows an error without saying why, and no function or class is left that
nothing names (dead code).

The import rules (layers, cycles, where torch may enter) are in test_layers.py."""

import ast
import re
from collections import Counter
from pathlib import Path

import primuspipe

ROOT = Path(primuspipe.__file__).parent
REPO = Path(__file__).resolve().parents[2]

BROAD = {"Exception", "BaseException"}

OUTSIDE_INTERFACES = {
    "is_success": "torch.distributed's Work, which the NCCL emulator's requests stand in for",
    "get_future": "torch.distributed's Work, which the NCCL emulator's requests stand in for",
    "getBackendName": "torch.distributed's backend, which the NCCL emulator's group stands in for",
    "default_stream": "torch.cuda's, which Megatron calls on CPU through the stand-in",
}
"""Methods that the code outside calls by name (torch, Megatron), so nothing in this repository names them."""


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(ROOT.rglob("*.py"))}


def test_every_module_says_what_it_is_for():
    bare = [str(path.relative_to(REPO)) for path, text in _sources().items()
            if text.strip() and not ast.get_docstring(ast.parse(text))]
    assert not bare, "modules without a docstring:\n" + "\n".join(bare)


def _catches_everything(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return caught is None or any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def test_a_catch_all_handler_reraises_or_says_why_it_does_not():
    """``except Exception`` (or ``BaseException``, or bare) hides bugs: it must raise again, or say on its line
    (``# noqa: BLE001 - why``) what the error may be and why the code goes on."""
    wrong = []
    for path, text in _sources().items():
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ExceptHandler) or not _catches_everything(node):
                continue
            reraises = any(isinstance(n, ast.Raise) for n in ast.walk(node))
            reason = re.search(r"#.*noqa: BLE001 - \S", lines[node.lineno - 1])
            if node.type is None or not (reraises or reason):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not wrong, "catch-all handlers that neither re-raise nor say why:\n" + "\n".join(wrong)


TEXT = (".py", ".md", ".sh", ".toml", ".cfg", ".yaml", ".yml")
"""The files a name may stand in: code, docs, scripts, packaging and data (not results)."""


def _named_anywhere() -> Counter:
    """How often each word stands in the repository's text files (hidden folders, a virtual environment
    among them, left out)."""
    words: Counter = Counter()
    for top in REPO.iterdir():
        if top.name.startswith("."):
            continue
        for path in [top] if top.is_file() else top.rglob("*"):
            hidden = any(part.startswith(".") for part in path.relative_to(REPO).parts)
            if path.suffix in TEXT and path.is_file() and not hidden:
                words.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
    return words


def _definitions(tree: ast.Module) -> list[ast.FunctionDef | ast.ClassDef]:
    """A module's classes and functions and its classes' methods; those with a decorator other than
    ``staticmethod``, ``classmethod`` or ``property`` are left out (a registration names them)."""
    plain = {"staticmethod", "classmethod", "property"}
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    found = [n for n in tree.body if isinstance(n, kinds)]
    found += [m for c in found if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, kinds)]
    return [d for d in found if not d.name.startswith("__")
            and all(isinstance(x, ast.Name) and x.id in plain for x in d.decorator_list)]


def test_every_function_and_class_is_named_somewhere_else():
    """Dead code: a definition whose name stands nowhere but in its own ``def`` (no call, import, test, doc or
    entry point) is removed, not kept. A name only tests use is kept: it is the API they exercise."""
    words = _named_anywhere()
    dead = [f"{path.relative_to(REPO)}:{d.lineno} {d.name}" for path, text in _sources().items()
            for d in _definitions(ast.parse(text)) if words[d.name] <= 1 and d.name not in OUTSIDE_INTERFACES]
    assert not dead, "defined but never named:\n" + "\n".join(dead)
