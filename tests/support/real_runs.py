"""A real CPU run to calibrate from: gloo ranks run 1F1B with dump_pp_data (shared by the tests of the
prediction path and of calibrating several runs)."""

import torch
import torch.distributed as dist

from primuspipe.runtime.driver import StepDriver, cached_schedule
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.testing.gloo import run_gloo

PP, M, H = 2, 6, 64


def train_1f1b(dump_dir, steps: int) -> None:
    """``steps`` training steps of a 2-rank 1F1B pipeline of linear layers, dumped to ``dump_dir``."""
    def work(rank: int, world: int) -> None:
        table = cached_schedule("1f1b", PP, 1, M)
        torch.manual_seed(rank)
        # rank 0's stage twice rank 1's: rank 1 always waits for its inputs, so transfers are timed even
        # when the machine is busy (with equal stages a loaded run could show no wait at all)
        layers = 8 if rank == 0 else 4
        stage = torch.nn.Sequential(*[torch.nn.Linear(H, H) for _ in range(layers)], torch.nn.Tanh())
        driver = StepDriver(watchdog_timeout_s=60, dump_dir=str(dump_dir))
        for _ in range(steps):
            binder = ModuleBinder([stage], num_stages=PP, inputs=[torch.randn(16, H) for _ in range(M)],
                                  loss_fn=lambda out, mb: out.pow(2).mean(), transfer_shape=(16, H))
            driver.execute(table, rank, binder, dist.group.WORLD, device=torch.device("cpu"))

    run_gloo(work, PP)
