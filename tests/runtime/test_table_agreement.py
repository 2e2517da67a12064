"""Every rank checks, before a table's first step on a process group, that all ranks hold the same
table: real gloo processes, one of them handed a different table, refuse before any node runs and name
both ranks; agreeing ranks check once per (table, group) and then run."""

import torch
import torch.distributed as dist

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import TableMismatchError
from primuspipe.runtime.driver import StepDriver, table_digest
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.testing.gloo import run_gloo

H, BATCH = 4, 2


def _binder(table, rank):
    torch.manual_seed(0)
    chunks = [torch.nn.Linear(H, H) for _ in range(table.vpp)]
    inputs = [torch.randn(BATCH, H) for _ in range(table.microbatches)]
    return ModuleBinder(chunks, num_stages=table.num_stages, inputs=inputs, loss_fn=lambda out, mb: out.pow(2).mean(),
                        transfer_shape=(BATCH, H))


def _steps(tables, steps):
    """Each rank runs ``steps`` steps of its own table through one StepDriver; returns per rank how many
    table agreements it gathered and how many microbatch losses it computed."""

    def work(rank, world):
        table = tables[rank]
        gathers = []
        real = dist.all_gather_object

        def counting(*args, **kwargs):  # this process's own torch.distributed: counts the driver's gathers
            gathers.append(1)
            return real(*args, **kwargs)

        dist.all_gather_object = counting
        driver = StepDriver(watchdog_timeout_s=20)
        losses = 0
        try:
            for _ in range(steps):
                binder = _binder(table, rank)
                driver.execute(table, rank, binder, dist.group.WORLD, device=torch.device("cpu"))
                losses += len(binder.losses)
        except TableMismatchError as exc:
            return "refused", str(exc), len(gathers), losses
        return "ran", "", len(gathers), losses

    return run_gloo(work, len(tables), timeout_s=60)


def test_a_rank_with_another_table_refuses_before_the_first_step_naming_both_ranks():
    zbv = build_schedule("zbv", 2, 4)
    other = build_schedule("v-half", 2, 4)
    assert table_digest(zbv) != table_digest(other) and (zbv.pp, zbv.vpp) == (other.pp, other.vpp)
    results = _steps([zbv, other], steps=1)
    for rank, (status, message, gathers, losses) in enumerate(results):
        assert status == "refused" and losses == 0, (rank, status)
        assert "rank 0 holds 'zbv'" in message and "rank 1 holds 'v-half'" in message and f"this is rank {rank}" in message
        assert table_digest(zbv)[:16] in message and table_digest(other)[:16] in message


def test_agreeing_ranks_check_once_then_run_every_step():
    table = build_schedule("1f1b", 2, 3)
    results = _steps([table, table], steps=3)
    assert [r[0] for r in results] == ["ran", "ran"]
    assert [r[2] for r in results] == [1, 1]  # one gather for three steps
    assert results[1][3] == 3 * 3  # the last stage computed every microbatch's loss, every step
