"""The runnable examples in the library's docstrings stay true."""

import doctest
import importlib
import pkgutil

import pytest

import primuspipe

# The Megatron backend and its harness need CPU mode set up before import; tests/megatron covers them.
_SKIP = ("primuspipe.backends", "primuspipe.testing.megatron")


def _modules_with_examples() -> list[str]:
    """Modules whose docstrings hold at least one example; a module without any is not a passing test."""
    finder = doctest.DocTestFinder()
    names = sorted(m.name for m in pkgutil.walk_packages(primuspipe.__path__, "primuspipe.")
                   if not m.name.startswith(_SKIP))
    return [n for n in names if any(t.examples for t in finder.find(importlib.import_module(n)))]


MODULES = _modules_with_examples()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
