import pytest

from primuspipe.algorithms import registry


@pytest.fixture
def clean_registry():
    """Algorithms a test registers (or plug-ins it loads) are forgotten afterwards. The built-ins are
    registered first: their modules register once, on import, so a registry saved without them could
    never get them back."""
    registry._load_builtins()
    saved, loaded = dict(registry._REGISTRY), registry._plugins_loaded
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    registry._plugins_loaded = loaded
