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
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from primuspipe.backends.torch import split_sequential
from primuspipe.errors import ConfigError, PipelineHangError
from primuspipe.io.formats import load_table
from primuspipe.passes.streams import replay
from primuspipe.runtime import nccl_emulation
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.runtime.transport import P2PTransport
from primuspipe.testing.gloo import run_gloo
from primuspipe.testing.torch_pipelining import (
    local_stage_indices, mse, plain_model, sequential_reference, torch_schedule, torch_step,
)
from tiny_stages import BATCH, H, inputs, loss, stage

LEGACY = Path(__file__).parents[1] / "fixtures" / "legacy_1f1b_pp2_m4.json"
"""``primuspipe export 1f1b --pp 2 -m 4`` as exported before the transport got per-direction channels."""
MODES = ("pair", "group")


@pytest.fixture
def emulate(monkeypatch):
    """Set the emulation mode for the gloo ranks this test launches (they inherit the environment)."""
    def set_mode(mode):
        if mode is None:
            monkeypatch.delenv(nccl_emulation.ENV, raising=False)
        else:
            monkeypatch.setenv(nccl_emulation.ENV, mode)
    return set_mode


def _run_table(table, channels: str, timeout_s: float):
    """Each rank's (losses, grads) or the message of its hang error."""
    def work(rank, world):
        chunks = [stage(table.placement.stage(rank, c)) for c in range(table.vpp)]
        binder = ModuleBinder(chunks, num_stages=table.num_stages, inputs=inputs(table.microbatches),
                              loss_fn=loss, transfer_shape=(BATCH, H))
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
    # not batch_p2p_comm at pp=2 vpp=2: both neighbours are one rank and Megatron's batch posts that
    # direction's activation and gradient in opposite orders on the two ranks, which NCCL (it matches in
    # order) swaps as the emulator does; Megatron-LM's arguments refuse the combination
    (2, 2): (4, ({"batch_p2p_comm": False}, {"batch_p2p_comm": False, "overlap_p2p_comm": True})),
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


# -- every shipped algorithm through primuspipe's transport: bitwise what plain gloo gives ---------------

def _every_algorithm(pp: int, m: int):
    from primuspipe.algorithms.registry import list_algorithms
    from primuspipe.algorithms.build import build_schedule

    return {info.name: build_schedule(info.name, pp, m) for info in list_algorithms()}


def _torch_backend_run(pp: int, m: int):
    from primuspipe.backends.torch import TorchPipeline

    tables, hidden = _every_algorithm(pp, m), 16
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(2 * m, hidden, generator=gen), torch.randn(2 * m, hidden, generator=gen)

    def work(rank, world):
        out = {}
        for name, table in tables.items():
            cut = split_sequential(plain_model(hidden, layers=2 * table.num_stages), table.num_stages)
            own = {s: cut[s] for s in table.placement.stages[rank]}
            losses = TorchPipeline(table, own, loss_fn=mse, watchdog_timeout_s=60).step(x, target=y)
            out[name] = (losses, [p.grad for s in sorted(own) for p in own[s].parameters()])
        return out

    return run_gloo(work, pp, timeout_s=300)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _assert_bitwise_gloo_under_both_modes(run, emulate) -> None:
    """``run()`` (per rank: algorithm -> results) gives bitwise the same under each mode as on gloo."""
    runs = {}
    for mode in (None, *MODES):
        emulate(mode)
        runs[mode] = run()
    for mode in MODES:
        for rank, (want, got) in enumerate(zip(runs[None], runs[mode])):
            for name in want:
                assert _same(got[name], want[name]), f"{name} rank {rank} under {mode}"


@pytest.mark.slow
def test_every_algorithm_on_the_torch_backend_is_bitwise_gloo_under_both_modes(emulate):
    # an odd pipeline, 2pp+1 microbatches: a corner of the matrix
    _assert_bitwise_gloo_under_both_modes(lambda: _torch_backend_run(3, 7), emulate)


def _megatron_backend_run(pp: int, m: int):
    from primuspipe.backends.megatron.config import PrimusPipeConfig
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.testing.megatron import compare, tiny_models
    from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo

    tables = _every_algorithm(pp, m)

    def work(ctx):
        out = {}
        for name, table in tables.items():
            spec = compare.StepSpec(tiny_models.TINY_MODELS["tiny-gpt"], m, placement=compare.placement_of(table))
            result = compare.run_step(PrimusForwardBackward(PrimusPipeConfig(True, name)), spec, pp, table.vpp)
            out[name] = (result.losses, result.grads)
        return out

    return run_on_gloo(work, ParallelLayout(pp), timeout_s=400)


@megatron
@pytest.mark.slow
def test_every_algorithm_on_the_megatron_backend_is_bitwise_gloo_under_both_modes(emulate):
    _assert_bitwise_gloo_under_both_modes(lambda: _megatron_backend_run(2, 5), emulate)


# methods torch.distributed calls on a group that are not collectives (or that NCCL has no form of)
_NOT_COLLECTIVES = {"rank", "size", "_get_backend", "_start_coalescing", "_end_coalescing", "recv_anysource",
                    "monitored_barrier", "split_group", "shutdown", "abort", "new_group", "get_group_store",
                    "_wait_for_pending_works", "_has_hooks", "_set_default_backend", "_register_backend",
                    "_set_group_name", "_set_group_desc"}


def test_every_collective_torch_calls_on_a_group_is_emulated():
    # torch.distributed calls collectives as methods of the group (their names change between torch
    # versions: 2.13 calls all_gather_single where 2.5 called _allgather_base); one the emulator does not
    # define falls through to ProcessGroup's device dispatch and fails with "No backend type associated"
    source = Path(dist.distributed_c10d.__file__).read_text()
    called = set(re.findall(r"\b(?:group|pg)\.([A-Za-z_]+)\(", source)) & set(dir(dist.ProcessGroup))
    collectives = called - _NOT_COLLECTIVES
    assert {"all_gather_single", "allreduce", "send"} <= collectives, "the scan finds torch's calls"
    missing = sorted(n for n in collectives if n not in vars(nccl_emulation.EmulatedNCCLGroup))
    assert not missing, f"collectives torch calls that the emulator does not define: {missing}"


def _collectives(rank, world):
    """Every collective form Megatron and torch use, on the default group: their results."""
    out = {}
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    gathered = torch.empty(4 * world)
    dist.all_gather_into_tensor(gathered, x)
    out["all_gather_into_tensor"] = gathered
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world) * (rank + 1))
    out["reduce_scatter_tensor"] = scattered
    splits = [1 + (r + rank) % 2 for r in range(world)]  # uneven, as MoE token dispatch sends
    received = [1 + (rank + r) % 2 for r in range(world)]
    a2a = torch.empty(sum(received))
    dist.all_to_all_single(a2a, torch.full((sum(splits),), float(rank)), received, splits)
    out["all_to_all_single"] = a2a
    lists = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(lists, [torch.full((2,), float(rank * world + r)) for r in range(world)])
    out["all_to_all"] = torch.cat(lists)
    with dist._coalescing_manager(async_ops=True) as manager:  # the distributed optimizer's fused form
        both = [torch.empty(2 * world), torch.empty(3 * world)]
        dist.all_gather_into_tensor(both[0], torch.full((2,), float(rank)), async_op=True)
        dist.all_gather_into_tensor(both[1], torch.full((3,), float(rank + 1)), async_op=True)
    manager.wait()
    out["coalesced all_gather_into_tensor"] = torch.cat(both)
    total = torch.ones(3) * (rank + 1)
    dist.all_reduce(total)
    out["all_reduce"] = total
    return out


@pytest.mark.parametrize("mode", MODES)
def test_every_collective_form_gives_gloos_result(mode, emulate):
    emulate(None)
    want = run_gloo(_collectives, 2)
    emulate(mode)
    got = run_gloo(_collectives, 2)
    for rank in range(2):
        for name, value in want[rank].items():
            assert torch.equal(got[rank][name], value), f"{name} on rank {rank} under {mode}"
