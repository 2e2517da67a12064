"""Watchdog timeouts of finite but enormous size, through every door that sets one: ``TorchPipeline``'s argument,
``PrimusPipeConfig``, ``PRIMUSPIPE_WATCHDOG_TIMEOUT_S``, a ``PRIMUSPIPE_CONFIG`` file. A timeout of 1e15 s or more
was accepted and then overflowed a ``timedelta`` / C timeout at the first transfer of every rank (a traceback,
after the step began); each is now refused where it is set, naming the setting, and the largest accepted timeout
still runs a two-rank step."""

import importlib.util
import os

import pytest
import torch

from hostile_support import record, refused, run_api
from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.torch import TorchPipeline
from primuspipe.runtime.driver import MAX_TIMEOUT_S
from primuspipe.testing.gloo import run_gloo

TOO_LONG = [MAX_TIMEOUT_S * 1.0000001, 1e10, 1e12, 1e13, 1e15, 1e18, 2.0**63, 1e100, 1e308, 10**400]
"""Past :data:`MAX_TIMEOUT_S`: the ones at 1e15 and above broke the first transfer; the others are no watchdog."""


def _shown(timeout) -> str:
    return repr(float(timeout)) if timeout < 10**300 else str(timeout)


def _two_rank_step(timeout: float):
    def fn(rank: int, world: int):
        torch.manual_seed(0)
        pipe = TorchPipeline(build_schedule("1f1b", 2, 2), {rank: torch.nn.Linear(4, 4)},
                             loss_fn=torch.nn.functional.mse_loss, watchdog_timeout_s=timeout)
        x = torch.randn(4, 4)
        return pipe.step(x if rank == 0 else None, target=x if rank == 1 else None)

    return run_gloo(fn, 2, timeout_s=60)


@pytest.mark.parametrize("timeout", TOO_LONG, ids=_shown)
def test_torch_pipeline(timeout):
    table = build_schedule("1f1b", 1, 2)
    refused(run_api(TorchPipeline, table, {0: torch.nn.Linear(4, 4)}, loss_fn=torch.nn.functional.mse_loss,
                    watchdog_timeout_s=timeout), "watchdog_timeout_s", case=f"TorchPipeline watchdog {_shown(timeout)}")


def test_the_longest_accepted_timeout_runs_a_step():
    losses = _two_rank_step(MAX_TIMEOUT_S)[1]
    record("sound" if len(losses) == 2 else "refused", "TorchPipeline watchdog at the longest accepted timeout")
    assert len(losses) == 2


MEGATRON = importlib.util.find_spec("megatron") is not None


@pytest.mark.skipif(not MEGATRON, reason="megatron-core is not installed")
@pytest.mark.parametrize("door", ["config", "environment", "file"])
def test_megatron_settings(tmp_path, monkeypatch, door):
    from primuspipe.backends.megatron import PrimusPipeConfig, install, is_installed, uninstall
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    for var in [v for v in os.environ if v.startswith("PRIMUSPIPE_")]:
        monkeypatch.delenv(var)
    try:
        for timeout in TOO_LONG:
            text = _shown(timeout)
            if door == "config":
                outcome = run_api(lambda: install(PrimusPipeConfig(True, "1f1b", watchdog_timeout_s=timeout)))
            elif door == "environment":
                monkeypatch.setenv("PRIMUSPIPE_PATCH", "1")
                monkeypatch.setenv("PRIMUSPIPE_WATCHDOG_TIMEOUT_S", text)
                outcome = run_api(install)
            else:
                path = tmp_path / "primuspipe.yaml"
                path.write_text(f"patch_primus_pipeline: true\nwatchdog_timeout_s: {text}\n")
                monkeypatch.setenv("PRIMUSPIPE_CONFIG", str(path))
                outcome = run_api(install)
            refused(outcome, "watchdog_timeout_s", case=f"install {door} watchdog {text}")
            assert not is_installed()
    finally:
        uninstall()
