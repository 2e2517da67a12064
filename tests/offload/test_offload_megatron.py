"""The Megatron backend has no OFFLOAD/RELOAD handlers yet: an offloaded table is refused before the step
with the reason, never run without its copies (docs/offload.md, Limits)."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.errors import ConfigError  # noqa: E402
from primuspipe.ir.cost_model import CostModel, MemoryCost  # noqa: E402
from primuspipe.passes.offload import offload_activations  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402


class Offloaded(PrimusForwardBackward):
    """The configured algorithm's table, through the offload pass at a limit below its own peak."""

    def table_for(self, pp, vpp, num_microbatches, megatron_config=None):
        table = super().table_for(pp, vpp, num_microbatches, megatron_config)
        cost = CostModel.per_stage(table.num_stages, 1, 1, 1, memory=MemoryCost(w_retained_fraction=1.0))
        return offload_activations(table, cost, memory_limit=1.5)


def _worker(ctx):
    spec = compare.StepSpec(tiny_models.TINY_MODELS["tiny-gpt"], 4, placement="v")
    try:
        compare.run_step(Offloaded(PrimusPipeConfig(True, "v-half")), spec, 2, 2)
    except ConfigError as exc:
        return str(exc)
    return "ran"


def test_megatron_refuses_an_offloaded_table():
    for message in run_on_gloo(_worker, ParallelLayout(2, vpp=2), timeout_s=300):
        assert "OFFLOAD" in message and "no handler" in message and "run the table without offload" in message
