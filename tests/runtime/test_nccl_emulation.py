"""The NCCL emulator agrees with NCCL both ways, and every schedule runs under it.

* It does not hang what runs on NCCL: Megatron's own 1F1B and interleaved schedules (``batch_p2p_comm``
  on and off, ``overlap_p2p_comm``) and torch.distributed.pipelining's schedule classes, at pp 2 and 4,
  in both modes, with gradients equal to one process.
* It hangs what hangs on NCCL: a table posted unbatched on one group (primuspipe's transport before
  per-direction channels, ``channels="shared"``) -- and exactly where the validator's ``nccl-pair`` and
  ``nccl-group`` replays say each rank stops (the negative control: this test fails if the emulator
  stops catching the old posting).
* Every shipped algorithm, through primuspipe's transport, gives bitwise the losses and gradients of
  plain gloo under both modes (the corners of the matrix here; bench/bench_nccl_matrix.py runs all of it).
"""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from primuspipe.backends.torch import split_sequential
from primuspipe.errors import ConfigError, PipelineHangError
from primuspipe.ir.formats import load_table
from primuspipe.passes.streams import replay
from primuspipe.runtime import nccl_emulation
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.runtime.transport import P2PTransport
from primuspipe.testing.gloo import run_gloo
from primuspipe.testing.torch_pipelining import (
    local_stage_indices, mse, plain_model, sequential_reference, torch_schedule, torch_step,
)

LEGACY = Path(__file__).parents[1] / "fixtures" / "legacy_1f1b_pp2_m4.json"
"""``primuspipe export 1f1b --pp 2 -m 4`` as exported before the transport got per-direction channels."""
MODES = ("pair", "group")
H, BATCH = 6, 3


@pytest.fixture
def emulate(monkeypatch):
    """Set the emulation mode for the gloo ranks this test launches (they inherit the environment)."""
    def set_mode(mode):
        if mode is None:
            monkeypatch.delenv(nccl_emulation.ENV, raising=False)
        else:
            monkeypatch.setenv(nccl_emulation.ENV, mode)
    return set_mode


def _stage(stage: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(100 + stage)
    layer = torch.nn.Linear(H, H)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(H, H, generator=gen) * 0.5)
        layer.bias.copy_(torch.randn(H, generator=gen) * 0.1)
    return torch.nn.Sequential(layer, torch.nn.Tanh())


def _inputs(m: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH, H, generator=gen) for _ in range(m)]


def _loss(out: torch.Tensor, mb: int) -> torch.Tensor:
    return (out * (mb + 1)).pow(2).mean()


def _run_table(table, channels: str, timeout_s: float):
    """Each rank's (losses, grads) or the message of its hang error."""
    def work(rank, world):
        chunks = [_stage(table.placement.stage(rank, c)) for c in range(table.vpp)]
        binder = ModuleBinder(chunks, num_stages=table.num_stages, inputs=_inputs(table.microbatches),
                              loss_fn=_loss, transfer_shape=(BATCH, H))
        try:
            ScheduleRunner(table, rank).run(binder, P2PTransport(dist.group.WORLD, timeout_s=timeout_s,
                                                                 channels=channels))
        except PipelineHangError as exc:
            return str(exc)
        return binder.losses, [p.grad for c in chunks for p in c.parameters()]

    return run_gloo(work, table.pp, timeout_s=120)


def test_mode_comes_from_the_environment_and_a_typo_is_refused(emulate):
    emulate(None)
    assert nccl_emulation.mode() is None and nccl_emulation.cpu_backend() == "gloo"
    emulate("group")
    assert nccl_emulation.cpu_backend() == nccl_emulation.BACKEND
    emulate("pairs")
    with pytest.raises(ConfigError, match="PRIMUSPIPE_NCCL_EMULATION='pairs' is not an emulation mode"):
        nccl_emulation.mode()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_old_posting_hangs_where_the_replay_says(mode, emulate):
    """Negative control: the legacy table posted on one group hangs under the emulator; each rank's
    watchdog names the very receive the ``nccl-<mode>`` replay says that rank stops on."""
    table = load_table(LEGACY)
    hang = replay(table, f"nccl-{mode}")
    assert hang is not None and replay(table, "gloo") is None
    emulate(mode)
    reports = _run_table(table, "shared", timeout_s=3.0)
    for rank, report in enumerate(reports):
        assert isinstance(report, str), f"rank {rank} finished: the emulator no longer catches the old posting"
        waits_on = table.ranks[rank][hang.waits_on[rank]]
        assert f"pipeline rank {rank}: {waits_on} (receive from pipeline rank {1 - rank}) did not complete" in report


@pytest.mark.slow
def test_the_old_posting_runs_on_gloo_and_per_direction_channels_run_under_the_emulator(emulate):
    table = load_table(LEGACY)
    emulate(None)
    shared = _run_table(table, "shared", timeout_s=30.0)
    emulate("pair")
    channels = _run_table(table, "direction", timeout_s=30.0)
    for (want_losses, want_grads), (losses, grads) in zip(shared, channels):
        assert want_losses.keys() == losses.keys() and all(torch.equal(want_losses[k], losses[k]) for k in losses)
        assert len(grads) == len(want_grads) and all(torch.equal(a, b) for a, b in zip(want_grads, grads))


# -- Megatron's own schedules: what runs on NCCL runs under the emulator ------------------------------

megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

NATIVE = {  # (pp, vpp) -> microbatches, config variants Megatron allows for that schedule
    (2, 1): (4, ({"batch_p2p_comm": False}, {"batch_p2p_comm": True})),
    (4, 1): (6, ({"batch_p2p_comm": False}, {"batch_p2p_comm": True})),
    (2, 2): (4, ({"batch_p2p_comm": False}, {"batch_p2p_comm": True},
                 {"batch_p2p_comm": False, "overlap_p2p_comm": True})),
    (4, 2): (8, ({"batch_p2p_comm": False}, {"batch_p2p_comm": True},
                 {"batch_p2p_comm": False, "overlap_p2p_comm": True})),
}


@megatron
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pp,vpp", list(NATIVE), ids=lambda v: str(v))
def test_megatron_native_schedules_run_under_the_emulator(pp, vpp, mode, emulate):
    from megatron_harness import assert_same_tensors, pp1_references, stacked_losses

    from primuspipe.testing.megatron.cpu_step import PipelineCase, last_stage_losses, merged_grads, run_pipeline_cases
    from primuspipe.testing.megatron.distributed_cpu import ParallelLayout
    from primuspipe.testing.megatron import tiny_models

    m, variants = NATIVE[pp, vpp]
    reference = pp1_references(frozenset({(tiny_models.TINY_MODELS["tiny-gpt"], m, False)}))[
        (tiny_models.TINY_MODELS["tiny-gpt"], m, False)]
    emulate(mode)
    results = run_pipeline_cases(ParallelLayout(pp, vpp=vpp),
                                 [PipelineCase(m, config_overrides=v) for v in variants], timeout_s=240)
    for variant, case in zip(variants, results):
        got = torch.stack([d["lm loss"] for d in last_stage_losses(case)])
        torch.testing.assert_close(got, stacked_losses(reference), rtol=0, atol=1e-6, msg=str(variant))
        assert_same_tensors(merged_grads(case), reference.grads, f"grad {variant}")


# -- torch.distributed.pipelining's schedule classes ---------------------------------------------------

TORCH_CLASSES = [("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2),
                 ("ScheduleInterleavedZeroBubble", 2), ("ScheduleZBVZeroBubble", 2), ("ScheduleDualPipeV", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pp", (2, 4))
def test_torch_pipelining_schedules_run_under_the_emulator(pp, mode, emulate):
    m, hidden = 2 * pp, 16
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * m, hidden, generator=gen), torch.randn(2 * m, hidden, generator=gen)

    def work(rank, world):
        out = {}
        for name, vpp in TORCH_CLASSES:
            num_stages = pp * vpp
            cut = split_sequential(plain_model(hidden, layers=num_stages), num_stages)
            own = {s: cut[s] for s in local_stage_indices(name, pp, vpp, rank)}
            torch_step(torch_schedule(name, own, num_stages, m, mse), 0 in own, num_stages - 1 in own, (x,), y)
            out[name] = {s: [p.grad for p in mod.parameters()] for s, mod in own.items()}
        return out

    emulate(mode)
    results = run_gloo(work, pp, timeout_s=240)
    for name, vpp in TORCH_CLASSES:
        model = plain_model(hidden, layers=pp * vpp)
        _, want = sequential_reference(model, x, y, m)
        got = {s: g for rank in results for s, g in rank[name].items()}
        flat = [g for s in sorted(got) for g in got[s]]
        assert len(flat) == len(want), name
        for a, b in zip(flat, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
