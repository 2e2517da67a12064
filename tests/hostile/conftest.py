import pytest

from hostile_support import run_api, run_cli, write_summary


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def api():
    return run_api


def pytest_terminal_summary(terminalreporter):
    write_summary(terminalreporter)
