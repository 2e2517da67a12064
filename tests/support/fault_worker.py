"""One rank of a small pp=4 training run that a fault test breaks: ``python fault_worker.py OUT FAULT TIMEOUT``.

Ranks join a gloo group (``torchrun``'s environment, else ``RANK``/``WORLD_SIZE`` and the FileStore
``$FAULT_STORE``) and train a 1F1B pp=4 table step after step with the hang watchdog at ``TIMEOUT``
seconds. At step 3 rank 2 sends itself ``FAULT`` (``KILL`` or ``STOP``), after writing the wall-clock
time to ``OUT/fault_time``. A rank whose step fails prints ``error: <message>`` on stderr and exits 1;
each rank writes its pid to ``OUT/pid_<rank>`` so the test can clean up a stopped one.
"""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import PrimusPipeError
from primuspipe.runtime.reference_binder import ModuleBinder
from primuspipe.runtime.runner import ScheduleRunner
from primuspipe.runtime.transport import P2PTransport

H, BATCH, M, FAULTY_RANK, FAULT_STEP = 8, 2, 8, 2, 3


def main(out: Path, fault: str, timeout_s: float) -> int:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    else:
        store = dist.FileStore(os.environ["FAULT_STORE"], world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    (out / f"pid_{rank}").write_text(str(os.getpid()))
    table = build_schedule("1f1b", pp=world, microbatches=M)
    binder = ModuleBinder([torch.nn.Linear(H, H)], num_stages=world, inputs=[torch.randn(BATCH, H) for _ in range(M)],
                          loss_fn=lambda y, mb: y.pow(2).mean(), transfer_shape=(BATCH, H))
    runner = ScheduleRunner(table, rank)
    for step in range(10_000):
        if rank == FAULTY_RANK and step == FAULT_STEP:
            (out / "fault_time").write_text(repr(time.time()))
            os.kill(os.getpid(), getattr(signal, f"SIG{fault}"))
        try:
            runner.run(binder, P2PTransport(dist.group.WORLD, timeout_s=timeout_s))
        except PrimusPipeError as exc:
            sys.stderr.write(f"error: {exc}\n")
            sys.stderr.flush()
            os._exit(1)  # the group is broken: no clean teardown to wait for
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])))
