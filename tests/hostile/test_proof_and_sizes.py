"""Proof before execution, and sizes refused up front.

The runner (and so the Megatron backend and every backend on the StepDriver) runs only proven tables:
a table whose two receives were swapped by hand -- which once trained to the end with the loss off by
1.7 -- is refused before any node runs; the proof is computed once per table object. Shapes too large
to build and check in reasonable time are refused before anything is built, with the size."""

import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hostile_support import record, refused, run_api, run_cli
from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ValidationError
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes import validation
from primuspipe.runtime.driver import StepDriver
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.testing.gloo import run_gloo

H, BATCH = 4, 2


def swapped(table: ScheduleTable, rank: int, i: int, j: int) -> ScheduleTable:
    row = list(table.ranks[rank])
    row[i], row[j] = row[j], row[i]
    return table.with_ranks(row if r == rank else table.ranks[r] for r in range(table.pp))


def receive_pairs(table: ScheduleTable):
    """(rank, i, j): two receives on one rank from one peer carrying different tensors."""
    for rank, row in enumerate(table.ranks):
        recvs = [(i, n) for i, n in enumerate(row) if n.kind.is_recv]
        for a, (i, x) in enumerate(recvs):
            for j, y in recvs[a + 1:]:
                if x.peer == y.peer and (x.kind, x.microbatch, x.chunk) != (y.kind, y.microbatch, y.chunk):
                    yield rank, i, j


@settings(max_examples=40)
@given(st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv"]), st.integers(2, 4), st.integers(2, 6),
       st.data())
def test_swapped_receives_are_refused_before_running(algorithm, pp, m, data):
    if algorithm in ("interleaved-1f1b",) and m < pp or algorithm == "zbv" and m < 2 * pp:
        m = 2 * pp
    table = build_schedule(algorithm, pp, m)
    pairs = list(receive_pairs(table))
    assume(pairs)
    rank, i, j = data.draw(st.sampled_from(pairs))
    bad = swapped(table, rank, i, j)
    outcome = refused(run_api(ScheduleRunner, bad, data.draw(st.integers(0, pp - 1))),
                      case=f"runner {algorithm} pp={pp} m={m} swap rank {rank} nodes {i},{j}")
    assert outcome.message.startswith("[") or "rank" in outcome.message


def test_the_proof_is_computed_once_per_table(monkeypatch):
    calls = []
    real = validation.check_deadlock
    monkeypatch.setattr(validation, "check_deadlock", lambda t, *semantics: (calls.append(t), real(t, *semantics)))
    table = build_schedule("1f1b", pp=4, microbatches=8)
    assert len(calls) == 1
    for rank in range(4):
        ScheduleRunner(table, rank)
    assert len(calls) == 1, "a table build_schedule proved is not proven again"
    copy = ScheduleTable.from_json(table.to_json())  # an equal table from elsewhere: proven once, then cached
    ScheduleRunner(copy, 0)
    ScheduleRunner(copy, 1)
    assert len(calls) == 2


def test_a_forward_only_proof_does_not_stand_for_a_full_one():
    from primuspipe.passes.forward_only import forward_only_view

    view = forward_only_view(build_schedule("1f1b", pp=2, microbatches=2))
    ScheduleRunner(view, 0)  # proven without completeness: runs as the forward-only step it is
    with pytest.raises(ValidationError, match="completeness"):
        validation.validate(view)


def test_swapped_receives_through_the_driver_never_compute():
    """The issue's case on real gloo processes: two receives of rank 1 swapped, run through the
    StepDriver every backend (Megatron's included) executes with. Both ranks refuse; no handler ran."""
    table = build_schedule("1f1b", pp=2, microbatches=3)
    rank, i, j = next(receive_pairs(table))
    bad = swapped(table, rank, i, j)

    def work(rank, world):
        calls = []
        stage = torch.nn.Linear(H, H)
        binder = ModuleBinder([stage], num_stages=2, inputs=[torch.randn(BATCH, H) for _ in range(3)],
                              loss_fn=lambda out, mb: out.sum(), transfer_shape=(BATCH, H))
        binder.handlers = {k: (lambda *a, h=h: (calls.append(1), h(*a))[1]) for k, h in binder.handlers.items()}
        try:
            StepDriver(watchdog_timeout_s=20).execute(bad, rank, binder, dist.group.WORLD, device=torch.device("cpu"))
        except ValidationError as exc:
            return str(exc).splitlines()[0], len(calls)
        return "ran", len(calls)

    for message, calls in run_gloo(work, 2, timeout_s=60):
        record("clear" if message != "ran" and calls == 0 else "silent", "driver swapped receives")
        assert message != "ran" and calls == 0, message


@pytest.mark.parametrize("args, names", [
    (("1f1b", 100_000, 8), ["100,000", "nodes"]),
    (("1f1b", 4, 10**9), ["1,000,000,000", "nodes"]),
    (("interleaved-1f1b", 512, 4096, 4), ["nodes"]),
    (("zb-auto", 64, 10**6), ["nodes"]),
    (("1f1b", 4, 2.5), ["integer"]),
    (("1f1b", True, 4), ["integer"]),
    (("1f1b", 0, 4), [">= 1"]),
])
def test_shapes_too_large_or_not_integers(args, names):
    start = time.monotonic()
    refused(run_api(build_schedule, *args), *names, case=f"build_schedule{args}")
    assert time.monotonic() - start < 1.0, "refused up front, before anything is built"


@pytest.mark.parametrize("argv", [
    ["show", "1f1b", "--pp", "100000", "-m", "8"],
    ["export", "1f1b", "--pp", "4", "-m", "1000000000", "-o", "never.json"],
    ["simulate", "--algorithm", "all", "--pp", "4", "-m", "1000000000"],
    ["simulate", "--algorithm", "zb-auto", "--pp", "100000", "-m", "8"],
])
def test_cli_refuses_huge_shapes_at_once(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    refused(run_cli(argv), "nodes", case=" ".join(argv))
    assert time.monotonic() - start < 5.0 and not (tmp_path / "never.json").exists()


def test_a_table_file_claiming_a_huge_shape(tmp_path):
    import json

    data = json.loads(build_schedule("1f1b", pp=2, microbatches=2).to_json())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**data, "microbatches": 10**9}))
    refused(run_cli(["validate", path]), "nodes", case="table microbatches 10**9")
