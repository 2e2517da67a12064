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


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group for the cases that run a step in this process (binders, the torch pipeline)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def api():
    return run_api


def pytest_terminal_summary(terminalreporter):
    write_summary(terminalreporter)
