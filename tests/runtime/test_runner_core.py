"""The runner on plain torch modules over real gloo processes: every table gives the gradients of one
sequential model, including pp=2 with vpp=2 (both neighbours are one rank) and a V-shape table with
same-rank hand-offs; binders without a handler are refused; a stuck peer trips the watchdog."""

import time

import pytest
import torch
import torch.distributed as dist
from primuspipe.testing.gloo import WorkerError, run_gloo

from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.passes.communication import add_communication
from primuspipe.errors import ConfigError, PipelineHangError
from primuspipe.ir.node import BW, F, NodeKind, ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.passes.forward_only import forward_only_view
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.table import ScheduleTable
from primuspipe.runtime.transport import P2PTransport
from primuspipe.passes.validation import validate
from tiny_stages import BATCH, H, inputs, loss, stage


def _reference(num_stages: int, m: int):
    stages = [stage(s) for s in range(num_stages)]
    losses = []
    for mb, x in enumerate(inputs(m)):
        for s in stages:
            x = s(x)
        value = loss(x, mb)
        value.backward()
        losses.append(value.detach())
    grads = {(s, n): p.grad for s, st in enumerate(stages) for n, p in st.named_parameters()}
    return losses, grads


def _run_table(table: ScheduleTable, forward_only: bool = False, timeout_s: float = 30.0):
    def work(rank, world):
        placement = table.placement
        chunks = [stage(placement.stage(rank, c)) for c in range(table.vpp)]
        binder = ModuleBinder(chunks, num_stages=table.num_stages, inputs=inputs(table.microbatches),
                              loss_fn=loss, transfer_shape=(BATCH, H))
        events = []

        class Rec:
            clock = staticmethod(time.perf_counter)

            def record(self, node, start, end, tensor=None):
                events.append((str(node), start, end))

        run_table = forward_only_view(table) if forward_only else table
        transport = P2PTransport(dist.group.WORLD, timeout_s=timeout_s)
        ScheduleRunner(run_table, rank).run(binder, transport, Rec())
        grads = {(placement.stage(rank, c), n): p.grad for c, ch in enumerate(chunks) for n, p in ch.named_parameters()}
        return binder.losses, grads, events, [str(n) for n in run_table.ranks[rank]]

    return run_gloo(work, table.pp)


def _vshape_table(pp: int, m: int) -> ScheduleTable:
    rows = [[F(i, 0) for i in range(m)] + [F(i, 1) for i in range(m)] + [BW(i, 1) for i in range(m)]
            + [BW(i, 0) for i in range(m)] for _ in range(pp)]
    return validate(add_communication(ScheduleTable.build(Placement.vshape(pp), m, rows, "v-gpipe")))


TABLES = [
    ("1f1b-pp2-m1", lambda: build_schedule("1f1b", pp=2, microbatches=1)),
    ("1f1b-pp3-m5", lambda: build_schedule("1f1b", pp=3, microbatches=5)),
    ("gpipe-pp3-m2", lambda: build_schedule("gpipe", pp=3, microbatches=2)),
    ("interleaved-pp2-vpp2-m4", lambda: build_schedule("interleaved-1f1b", pp=2, vpp=2, microbatches=4)),
    ("interleaved-pp2-vpp2-m3-g3", lambda: build_schedule("interleaved-1f1b", pp=2, vpp=2, microbatches=3,
                                                          microbatch_group_size=3)),
    ("gpipe-pp2-vpp2-m3", lambda: build_schedule("gpipe", pp=2, vpp=2, microbatches=3)),
    ("vshape-pp2-m3", lambda: _vshape_table(2, 3)),
]


@pytest.mark.parametrize("name,make", TABLES, ids=[t[0] for t in TABLES])
def test_runner_matches_sequential_model(name, make):
    table = make()
    results = _run_table(table)
    want_losses, want_grads = _reference(table.num_stages, table.microbatches)
    got_grads = {k: v for _, grads, _, _ in results for k, v in grads.items()}
    assert got_grads.keys() == want_grads.keys()
    for key in want_grads:
        torch.testing.assert_close(got_grads[key], want_grads[key], rtol=0, atol=1e-6, msg=str(key))
    last_rank = table.placement.rank_of(table.num_stages - 1)
    losses = results[last_rank][0]
    torch.testing.assert_close(torch.stack([losses[i] for i in range(table.microbatches)]), torch.stack(want_losses))
    for _, _, events, row in results:
        assert [e[0] for e in events if not e[0].startswith(("SEND", "RECV"))] == [n for n in row if not n.startswith(("SEND", "RECV"))]
        assert sorted(e[0] for e in events) == sorted(row), "every node is recorded once"
        assert all(start <= end for _, start, end in events)


def test_forward_only_view_gives_the_same_losses():
    table = build_schedule("interleaved-1f1b", pp=2, vpp=2, microbatches=4)
    view = forward_only_view(table)
    assert all(n.kind in (NodeKind.F, NodeKind.SEND_F, NodeKind.RECV_F) for _, _, n in view.positions())
    assert forward_only_view(table) is view, "views are cached per table"
    results = _run_table(table, forward_only=True)
    want_losses, _ = _reference(table.num_stages, table.microbatches)
    losses = results[table.placement.rank_of(table.num_stages - 1)][0]
    torch.testing.assert_close(torch.stack([losses[i] for i in range(4)]), torch.stack(want_losses))
    assert all(g is None for _, grads, _, _ in results for g in grads.values())


def test_forward_only_view_runs_an_overlapped_pair_as_its_forward():
    table = build_schedule("dualpipe-v", pp=2, microbatches=4)
    assert any(n.kind is NodeKind.FB for _, _, n in table.positions())
    view = forward_only_view(table)
    for row, full in zip(view.ranks, table.ranks):
        assert all(n.kind in (NodeKind.F, NodeKind.SEND_F, NodeKind.RECV_F) for n in row)
        want = [ScheduleNode(*part) for n in full for part in n.parts() if part[0] is NodeKind.F]
        assert [n for n in row if n.kind is NodeKind.F] == want, "every forward, in the table's order"


def test_binder_without_a_handler_is_refused():
    compute = build_schedule("1f1b", pp=2, microbatches=2, communication=False)
    split = compute.with_ranks(
        [p for n in row for p in ((ScheduleNode(NodeKind.B, n.microbatch, n.chunk), ScheduleNode(NodeKind.W, n.microbatch, n.chunk))
                                  if n.kind is NodeKind.BW else (n,))]
        for row in compute.ranks
    )
    runner = ScheduleRunner(validate(add_communication(split)), rank=0)
    binder = ModuleBinder([stage(0)], num_stages=2, inputs=inputs(2), loss_fn=loss, transfer_shape=(BATCH, H))
    with pytest.raises(ConfigError, match=r"has B, W nodes but ModuleBinder has no handler"):
        runner.handlers_for(binder)
    with pytest.raises(ConfigError, match="full table"):
        ScheduleRunner(compute, rank=0)


def test_stuck_peer_raises_pipeline_hang_error_within_the_timeout():
    table = build_schedule("1f1b", pp=2, microbatches=2)

    def work(rank, world):
        if rank == 0:
            time.sleep(3)  # stuck: never sends
            return None
        binder = ModuleBinder([stage(1)], num_stages=2, inputs=inputs(2), loss_fn=loss, transfer_shape=(BATCH, H))
        start = time.monotonic()
        try:
            ScheduleRunner(table, rank).run(binder, P2PTransport(dist.group.WORLD, timeout_s=1.0))
        except PipelineHangError as exc:
            return str(exc), time.monotonic() - start
        return "no error", 0.0

    try:
        results = run_gloo(work, 2)
    except WorkerError as exc:  # the hang error must come from the watchdog, not from elsewhere
        raise AssertionError(str(exc)) from exc
    message, elapsed = results[1]
    assert "pipeline rank 1" in message and "RECV_F0.0<0" in message and "pipeline rank 0" in message, message
    assert 0.9 <= elapsed < 4.0
