"""A new kind that costs time is one table entry plus one handler.

``RECOMPUTE`` rebuilds a microbatch's forward graph right before its backward (activation
recomputation as a node of its own). Defined once with :func:`define_kind`, with its own cost key, it
parses, validates, is timed by the simulator from a cost file's ``compute.recompute`` like any built-in
kind, and runs on gloo through the one handler a binder is given -- no other code knows about it.
"""

import pytest
import torch
import torch.distributed as dist
import yaml

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, ValidationError
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.kinds import Category, KindSpec, NodeKind, define_kind, forget_kind
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import validate
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.runtime.transport import P2PTransport
from primuspipe.simulator import simulate
from primuspipe.testing.gloo import run_gloo

RECOMPUTE_SPEC = KindSpec("RECOMPUTE", Category.COMPUTE, "recompute forward", completes=("RECOMPUTE",),
                          needs=(("F", 0),), optional=True, cost="recompute", color="#aaaa00")
COSTS = {"time_unit": "ms", "compute": {"f": 1, "b": 1, "w": 1, "recompute": [0.5, 0.25]}}


@pytest.fixture
def recompute():
    kind = define_kind(RECOMPUTE_SPEC)  # the one table entry
    yield kind
    forget_kind(kind)


def _recomputing(kind: NodeKind, pp: int = 2, microbatches: int = 3) -> ScheduleTable:
    """1F1B with a RECOMPUTE right before every backward."""
    table = build_schedule("1f1b", pp=pp, microbatches=microbatches).compute_only()
    rows = [[x for n in row for x in ((ScheduleNode(kind, n.microbatch, n.chunk), n) if n.kind is NodeKind.BW else (n,))]
            for row in table.ranks]
    return validate(add_communication(table.with_ranks(rows)))


def _cost_file(tmp_path, costs: dict) -> str:
    path = tmp_path / "costs.yaml"
    path.write_text(yaml.safe_dump(costs))
    return str(path)


def test_it_validates_and_is_timed_from_the_cost_file(recompute, tmp_path):
    table = _recomputing(recompute)
    assert ScheduleTable.from_json(table.to_json()) == table and "F0 F1 RECOMPUTE0 BW0" in table.compact_grid()
    cost = CostModel.load(_cost_file(tmp_path, COSTS), pp=2, vpp=1)
    result = simulate(table, cost)
    durations = {(r.rank, round(e.end - e.start, 9)) for r in result.ranks for e in r.events if e.node.kind is recompute}
    assert durations == {(0, 0.5), (1, 0.25)}, "each stage's own recompute time, from its key in the file"
    # by hand, free P2P, f = 1, bw = 2: rank 1 runs F0 R0 BW0 F1 R1 BW1 F2 R2 BW2, rank 0 F0 F1 R0 BW0 F2 R1
    # BW1 R2 BW2; rank 0's last BW waits for rank 1's, which ends at 10.75
    assert result.step_time == pytest.approx(12.75)
    assert CostModel.from_dict(cost.to_dict(), pp=2, vpp=1) == cost, "the key survives the YAML round trip"
    free = CostModel.per_stage(2, 1, 1, 1, other={"recompute": 0})
    assert simulate(table, free).step_time == simulate(build_schedule("1f1b", pp=2, microbatches=3), free).step_time


def test_a_cost_file_without_its_key_is_refused_in_one_line(recompute, tmp_path):
    table = _recomputing(recompute)
    cost = CostModel.load(_cost_file(tmp_path, {"compute": {"f": 1, "b": 1, "w": 1}}), pp=2, vpp=1)
    with pytest.raises(ConfigError, match=r"no times for RECOMPUTE nodes: add compute.recompute") as err:
        simulate(table, cost)
    assert "\n" not in str(err.value)


def test_its_key_is_unknown_once_the_kind_is_gone(tmp_path):
    with pytest.raises(ConfigError, match="recompute"):
        CostModel.load(_cost_file(tmp_path, COSTS), pp=2, vpp=1)


def test_the_validator_applies_its_needs(recompute):
    table = _recomputing(recompute).compute_only()
    row = list(table.ranks[1])
    row.insert(0, row.pop(1))  # RECOMPUTE0.0 before F0.0, which it needs
    with pytest.raises(ValidationError, match=r"\[order\].*RECOMPUTE0.0"):
        validate(table.with_ranks([table.ranks[0], row]))


def test_it_runs_on_gloo_through_its_one_handler(recompute):
    """The handler rebuilds the forward graph the backward then runs through (the first forward's graph
    is dropped), so the gradients are the plain schedule's, bit for bit, with every microbatch recomputed
    once per stage before its backward."""
    table = _recomputing(recompute)
    plain = validate(build_schedule("1f1b", pp=2, microbatches=3))

    def work(rank, world):
        def run(t, with_handler):
            torch.manual_seed(rank)
            chunk = torch.nn.Linear(4, 4)
            binder = ModuleBinder([chunk], num_stages=2, inputs=[torch.ones(2, 4) * (i + 1) for i in range(3)],
                                  loss_fn=lambda out, mb: out.pow(2).mean(), transfer_shape=(2, 4))
            order = []

            def rebuild(call):  # the one handler: recompute the chunk's forward from its saved input
                x, _ = binder._saved[(call.chunk, call.microbatch)]
                y = chunk(binder.inputs[call.microbatch] if x is None else x)
                binder._saved[(call.chunk, call.microbatch)] = (x, binder.loss_fn(y, call.microbatch) if rank == 1 else y)
                order.append(("R", call.microbatch))

            if with_handler:
                backward = binder.handlers[NodeKind.BW]
                binder.handlers = {**binder.handlers, recompute: rebuild,
                                   NodeKind.BW: lambda call: (order.append(("BW", call.microbatch)), backward(call))[1]}
            ScheduleRunner(t, rank).run(binder, P2PTransport(dist.group.WORLD, timeout_s=30))
            return order, [p.grad.clone() for p in chunk.parameters()]

        order, grads = run(table, True)
        _, plain_grads = run(plain, False)
        return order, all(torch.equal(a, b) for a, b in zip(grads, plain_grads))

    results = run_gloo(work, 2)
    for order, same in results:
        assert same, "recomputed gradients differ from the plain schedule's"
        assert order == [x for mb in range(3) for x in (("R", mb), ("BW", mb))]
