"""Node kinds are data: a new kind is one table entry plus one handler.

The toy kind ``PROBE`` inspects a microbatch's activation right after its forward (a statistics probe,
say). Defined once with :func:`define_kind`, it parses and prints, the validator checks it, the
communication pass and the simulator handle it, and the runner calls the handler a binder gives it --
no other code knows about it.
"""

import pytest
import torch
import torch.distributed as dist

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ValidationError
from primuspipe.ir.kinds import Category, KindSpec, NodeKind, all_kinds, define_kind, forget_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import validate
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.runtime.transport import P2PTransport
from primuspipe.simulator import CostModel, simulate
from primuspipe.testing.gloo import run_gloo

PROBE_SPEC = KindSpec("PROBE", Category.COMPUTE, "activation probe", completes=("PROBE",), needs=(("F", 0),),
                      optional=True)


@pytest.fixture
def probe():
    kind = define_kind(PROBE_SPEC)  # the one table entry
    yield kind
    forget_kind(kind)


def _with_probes(table: ScheduleTable, probe: NodeKind) -> ScheduleTable:
    """The compute-only table with a PROBE right after every forward."""
    rows = [[x for n in row for x in ((n, ScheduleNode(probe, n.microbatch, n.chunk)) if n.kind is NodeKind.F else (n,))]
            for row in table.compute_only().ranks]
    return table.compute_only().with_ranks(rows)


def test_a_new_kind_is_one_table_entry(probe):
    assert ScheduleNode.parse("PROBE3.1") == ScheduleNode(probe, 3, 1) and str(ScheduleNode(probe, 3, 1)) == "PROBE3.1"
    assert probe in all_kinds() and probe.is_compute
    table = validate(add_communication(_with_probes(build_schedule("1f1b", pp=2, microbatches=3), probe)))
    plain = simulate(build_schedule("1f1b", pp=2, microbatches=3), CostModel.per_stage(2, 1, 1, 1))
    assert simulate(table, CostModel.per_stage(2, 1, 1, 1)).step_time == plain.step_time  # it costs no time


def test_the_validator_applies_the_new_kinds_rules(probe):
    table = _with_probes(build_schedule("1f1b", pp=2, microbatches=2), probe)
    row = list(table.ranks[0])
    row.insert(0, row.pop(1))  # PROBE0.0 before F0.0, which it needs
    with pytest.raises(ValidationError, match=r"\[order\].*PROBE0.0"):
        validate(table.with_ranks([row, table.ranks[1]]))
    twice = [list(table.ranks[0]) + [ScheduleNode(probe, 0, 0)], table.ranks[1]]
    with pytest.raises(ValidationError, match=r"\[completeness\]"):
        validate(table.with_ranks(twice))


def test_the_runner_calls_the_new_kinds_handler(probe):
    table = validate(add_communication(_with_probes(build_schedule("1f1b", pp=2, microbatches=3), probe)))

    def work(rank, world):
        torch.manual_seed(rank)
        chunks = [torch.nn.Linear(4, 4)]
        binder = ModuleBinder(chunks, num_stages=2, inputs=[torch.ones(2, 4) * i for i in range(3)],
                              loss_fn=lambda out, mb: out.pow(2).mean(), transfer_shape=(2, 4))
        probed = []
        binder.handlers = {**binder.handlers, probe: lambda call: probed.append((call.microbatch, call.stage))}  # the one handler
        ScheduleRunner(table, rank).run(binder, P2PTransport(dist.group.WORLD, timeout_s=30))
        return probed

    assert run_gloo(work, 2) == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1)]]
