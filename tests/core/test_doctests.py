"""The runnable examples in the library's docstrings stay true."""

import doctest
import importlib
import pkgutil

import pytest

import primuspipe

# The Megatron backend needs CPU mode set up before import; its behaviour is tested in tests/megatron.
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(primuspipe.__path__, "primuspipe.")
    if not m.name.startswith("primuspipe.backends")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
