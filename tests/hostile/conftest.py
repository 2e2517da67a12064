import pytest

from hostile_support import run_api, run_cli, write_summary


@pytest.fixture
def forget_plugins():
    """Hostile plug-ins are forgotten after each test that registers them: ``simulate -a all`` must not meet them."""
    from primuspipe.algorithms import registry

    registry._load_builtins()
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def api():
    return run_api


def pytest_terminal_summary(terminalreporter):
    write_summary(terminalreporter)
