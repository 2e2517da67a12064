"""Offload inside real megatron-core training (CPU, gloo): a V-shape table with the offload pass's
OFFLOAD/RELOAD nodes gives the same losses and every gradient, bitwise, as the same table without them."""

import dataclasses
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.ir.cost_model import CostModel, MemoryCost  # noqa: E402
from primuspipe.passes.offload import offload_activations  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

M = 4


class Offloaded(PrimusForwardBackward):
    """The configured algorithm's table, through the offload pass at a limit below its own peak."""

    def table_for(self, pp, vpp, num_microbatches, megatron_config=None):
        table = super().table_for(pp, vpp, num_microbatches, megatron_config)
        cost = CostModel.per_stage(table.num_stages, 1, 1, 1, memory=MemoryCost(w_retained_fraction=1.0))
        return offload_activations(table, cost, memory_limit=1.5)


def _worker(ctx):
    spec = compare.StepSpec(tiny_models.TINY_MODELS["tiny-gpt"], M, placement="v")
    config = PrimusPipeConfig(True, "v-half")
    plain = compare.run_step(PrimusForwardBackward(config), spec, 2, 2)
    schedule = Offloaded(config)
    lean = compare.run_step(schedule, spec, 2, 2)
    offloads = sum(n.kind.name == "OFFLOAD" for n in schedule.table_for(2, 2, M).ranks[ctx.pp_rank])
    return plain, lean, offloads


def test_offload_in_megatron_is_bitwise_neutral():
    results = run_on_gloo(_worker, ParallelLayout(2, vpp=2), timeout_s=300)
    assert all(offloads > 0 for _, _, offloads in results), "every rank offloads something"
    for plain, lean, _ in results:
        assert len(plain.losses) == len(lean.losses)
        for a, b in zip(plain.losses, lean.losses):
            for key in a:
                assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert plain.grads.keys() == lean.grads.keys() and plain.grads
        for name, grad in plain.grads.items():
            assert (grad is None) == (lean.grads[name] is None)
            assert grad is None or torch.equal(grad, lean.grads[name]), f"{name} differs"
