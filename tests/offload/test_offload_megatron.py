"""Offload inside real megatron-core training (CPU, gloo, tiny GPT): ``offload: true`` under
``pp_max_mem`` runs the algorithm's table with the offload pass's OFFLOAD/RELOAD nodes.

Loss, every gradient (and, with Megatron DDP, every parameter after an SGD step) must be bitwise equal to
the same algorithm without offload, and the bytes autograd holds at each rank's peak must drop by what
the simulator predicts for the two tables within 5 %, the cost model's activation bytes taken from what
one forward of each stage saved. This caught a real bug: under saved-tensor hooks autograd unpacks a
saved weight as a new tensor, and a deferred W sent the weight gradient of a stage's last layer to it,
not to the parameter (wgrad_store.py)."""

import functools
import importlib.util
from typing import Any, NamedTuple

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.simulator import CostModel, MemoryCost, simulate  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

M = 4
CASES = {"v-half": ("v", 1.5), "interleaved-1f1b": ("interleaved", 1.5), "v-min": ("v", 1.5),
         "dualpipe-v": ("v", 2.0)}
"""algorithm -> (chunk placement, a memory limit below its own peak that offload can meet)"""


class _Rank(NamedTuple):
    """One rank's runs: without hooks, with counting only, with offload."""

    before: compare.StepResult
    after: compare.StepResult
    peak_plain: int
    peak_offload: int
    per_stage: dict[int, int]
    """Model stage -> bytes one forward of it saved (without offload)."""
    offloads: int
    moved_share: float | None
    plain_table: Any
    offload_table: Any


def _worker(ctx, algorithm, ddp, limit, ops="", fraction=None) -> _Rank:
    spec = compare.StepSpec(tiny_models.TINY_MODELS["tiny-gpt"], M, placement=CASES[algorithm][0], ddp=ddp,
                            optimizer_step=ddp)
    before = compare.run_step(PrimusForwardBackward(PrimusPipeConfig(True, algorithm)), spec, 2, 2)  # no hooks
    plain = PrimusForwardBackward(PrimusPipeConfig(True, algorithm), count_saved_bytes=True)
    _assert_bitwise(before, compare.run_step(plain, spec, 2, 2))  # counting alone changes nothing
    lean = PrimusForwardBackward(PrimusPipeConfig(True, algorithm, offload=True, pp_max_mem=limit, offload_ops=ops,
                                                  offload_fraction=fraction), count_saved_bytes=True)
    after = compare.run_step(lean, spec, 2, 2)
    table = lean.table_for(2, 2, M)
    per_stage = {table.placement.stage(ctx.pp_rank, c): b for c, b in plain.saved_bytes.per_forward.items()}
    offloads = sum(n.kind.name == "OFFLOAD" for n in table.ranks[ctx.pp_rank])
    return _Rank(before, after, plain.saved_bytes.peak, lean.saved_bytes.peak, per_stage, offloads,
                 lean.saved_bytes.moved_share(), plain.table_for(2, 2, M), table)


def _assert_bitwise(before, after):
    assert len(before.losses) == len(after.losses)
    for a, b in zip(before.losses, after.losses):
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
    assert before.grads.keys() == after.grads.keys() and before.grads
    for name, grad in before.grads.items():
        assert (grad is None) == (after.grads[name] is None)
        assert grad is None or torch.equal(grad, after.grads[name]), f"{name}'s gradient differs"
    for name, param in before.params.items():
        assert torch.equal(param, after.params[name]), f"{name} differs after the optimizer step"


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,ddp", [("v-half", False), ("v-half", True), ("interleaved-1f1b", False),
                                           ("v-min", True), ("dualpipe-v", False)])
def test_offload_in_megatron_is_bitwise_neutral_and_drops_the_peak_as_simulated(algorithm, ddp):
    results = run_on_gloo(functools.partial(_worker, algorithm=algorithm, ddp=ddp, limit=CASES[algorithm][1]),
                          ParallelLayout(2, vpp=2), timeout_s=300)
    assert any(r.offloads > 0 for r in results), "the pass offloads something"
    for r in results:
        _assert_bitwise(r.before, r.after)

    plain_table, lean_table = results[0].plain_table, results[0].offload_table
    per_stage = {s: b for r in results for s, b in r.per_stage.items()}
    memory = MemoryCost.per_stage(plain_table.num_stages, 2, w_retained_fraction=1.0,
                                  activation_bytes=[per_stage[s] for s in range(plain_table.num_stages)])
    cost = CostModel.per_stage(plain_table.num_stages, 1, 1, 1, memory=memory)
    predicted = [a - b for a, b in zip(simulate(plain_table, cost).peak_memory_bytes,
                                       simulate(lean_table, cost).peak_memory_bytes)]
    measured = [r.peak_plain - r.peak_offload for r in results]
    assert max(predicted) > 0
    for rank, (want, got) in enumerate(zip(predicted, measured)):
        assert abs(got - want) <= 0.05 * max(want, 1.0), f"rank {rank}: peak dropped {got} bytes, simulator says {want}"


@pytest.mark.slow
def test_offload_ops_move_only_those_ops_and_report_their_share():
    """Primus's ``offload_ops: row_parallel_gemm`` moves what Megatron's row-parallel linears save (the
    inputs of ``linear_proj`` and ``linear_fc2``): still bitwise neutral, and the moved share is measured."""
    results = run_on_gloo(functools.partial(_worker, algorithm="v-half", ddp=False, limit=1.9, ops="row_parallel_gemm",
                                            fraction=0.2),
                          ParallelLayout(2, vpp=2), timeout_s=300)
    for r in results:
        _assert_bitwise(r.before, r.after)
    shares = [r.moved_share for r in results]
    assert all(0 < share < 1 for share in shares), shares

