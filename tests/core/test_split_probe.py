"""The split-backward calibration probe: a fused-backward table with some middle backwards run as B then W
(some W after the next forward, some right after their B).

The pass keeps the order and the validator's guarantees; a real megatron-core run of probed 1F1B trains
bitwise as plain 1F1B (W adds exactly what BW's weight GEMMs add) and its dump gives calibrate real B
and W times (tests/tools/test_calibrate.py checks the recovery on a simulated dump)."""

import functools
import importlib.util

import pytest
import torch

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, TableFormatError
from primuspipe.ir.kinds import NodeKind
from primuspipe.passes.communication import add_communication
from primuspipe.passes.split_probe import probed_microbatches, split_backward_probe
from primuspipe.passes.validation import validate


@pytest.mark.parametrize("algorithm,vpp", [("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("count,microbatches", [(1, 8), (3, 8), (2, 4), (1, 4), (1, 2), (2, 12)])
def test_middle_backwards_become_b_and_w_in_both_placements_and_the_table_stays_valid(algorithm, vpp, count,
                                                                                     microbatches):
    pp = 2 if microbatches < 4 else 4
    table = build_schedule(algorithm, pp=pp, microbatches=microbatches, vpp=vpp)
    probed = add_communication(split_backward_probe(table.compute_only(), count))
    validate(probed)
    deferred, at_once = probed_microbatches(microbatches, count)
    assert at_once.stop == deferred.start and 1 <= len(at_once) <= count and 1 <= len(deferred) <= count + 1
    for before, after in zip(table.compute_only().ranks, probed.compute_only().ranks):
        names = [str(n) for n in after]
        split = {(n.chunk, n.microbatch) for n in after if n.kind is NodeKind.B}
        assert split == {(c, mb) for c in range(vpp) for mb in [*deferred, *at_once]}
        for chunk, mb in split:
            b, w = names.index(f"B{mb}.{chunk}"), names.index(f"W{mb}.{chunk}")
            if mb in at_once:
                assert w == b + 1, f"W{mb}.{chunk} is not right after its B"
            elif mb == deferred[-1]:
                assert names[w - 1] == f"W{mb - 1}.{chunk}" if len(deferred) > 1 else w == b + 1
            else:
                assert names[w - 1] == f"B{mb + 1}.{chunk}", f"W{mb}.{chunk} is not right after the next B"
        # without the Ws and with each B read as BW, the order is the table's own
        assert [n.replace("B", "BW", 1) if n.startswith("B") and not n.startswith("BW") else n
                for n in names if not n.startswith("W")] == [str(n) for n in before]
        # every chunk's weight gradients are added in microbatch order, as the fused table adds them
        for chunk in range(vpp):
            order = [n.microbatch for n in after if n.chunk == chunk and n.kind in (NodeKind.W, NodeKind.BW)]
            assert order == sorted(order)


def test_bad_inputs_are_refused():
    table = build_schedule("1f1b", pp=2, microbatches=4)
    with pytest.raises(TableFormatError, match="compute-only table"):
        split_backward_probe(table)
    with pytest.raises(ConfigError, match="count must be between 1 and the 4 microbatches, got 5"):
        split_backward_probe(table.compute_only(), 5)


needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


def _worker(ctx, probe):
    from primuspipe.backends.megatron.config import PrimusPipeConfig
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.testing.megatron import compare, tiny_models

    spec = compare.StepSpec(tiny_models.TINY_MODELS["tiny-gpt"], 4, ddp=True, optimizer_step=True)
    schedule = PrimusForwardBackward(PrimusPipeConfig(True, "1f1b", split_probe=probe))
    kinds = {n.kind.name for n in schedule.table_for(2, 1, 4).ranks[ctx.pp_rank]}
    return compare.run_step(schedule, spec, 2, 1), kinds


@needs_megatron
def test_a_probed_1f1b_run_trains_bitwise_as_plain_1f1b():
    from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo

    plain = run_on_gloo(functools.partial(_worker, probe=0), ParallelLayout(2), timeout_s=300)
    probed = run_on_gloo(functools.partial(_worker, probe=1), ParallelLayout(2), timeout_s=300)
    for (a, kinds_a), (b, kinds_b) in zip(plain, probed):
        assert "B" not in kinds_a and {"B", "W", "BW"} <= kinds_b
        for x, y in zip(a.losses, b.losses):
            assert all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)
        assert a.grads.keys() == b.grads.keys()
        for name, grad in a.grads.items():
            assert grad is None or torch.equal(grad, b.grads[name]), f"{name}'s gradient differs"
        for name, param in a.params.items():
            assert torch.equal(param, b.params[name]), f"{name} differs after the step"
