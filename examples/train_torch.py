"""Train a plain PyTorch model with any primuspipe schedule (no Megatron), on CPU (gloo) or GPU (nccl).

    torchrun --nproc-per-node 4 examples/train_torch.py --pp 4 --microbatches 8 --algorithm zbv
    torchrun --nproc-per-node 2 examples/train_torch.py --pp 2 --microbatches 4 --algorithm dualpipe-v --compare-torch
    torchrun --nproc-per-node 2 examples/train_torch.py --pp 2 --microbatches 4 --schedule my_order.csv

The model is an ``nn.Sequential`` of ``--layers`` blocks (Linear, GELU, LayerNorm), cut into the
table's ``pp * vpp`` stages; each rank builds the stages the table places on it. ``--schedule`` runs a
table from a file instead (primuspipe JSON, or a torch.distributed.pipelining CSV such as one torch's
own schedules wrote). With ``--compare-torch`` the same weights and data also go through
torch.distributed.pipelining's runtime running the same table from CSV, and the first iteration's
gradients are compared. The last line printed (rank 0) is one JSON object: ``algorithm``, ``losses``
(mean loss per iteration), ``step_time_s`` (median), and with ``--compare-torch``
``max_abs_grad_diff_vs_torch`` over all parameters of all ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from primuspipe.algorithms.build import build_schedule
from primuspipe.cli.options import count_type, number_type
from primuspipe.cli.parser import Parser
from primuspipe.backends.torch import TorchPipeline, split_sequential
from primuspipe.errors import ConfigError, PrimusPipeError
from primuspipe.io.formats import load_table
from primuspipe.strict import printable
from primuspipe.runtime import nccl_emulation


POSITIVE = count_type(1)
"""Every count flag: an integer >= 1 (0 iterations had no median step time to print, 0 layers no stage)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=POSITIVE, required=True,
                   help="pipeline-parallel size (= number of processes)")
    p.add_argument("--microbatches", type=POSITIVE, default=None, help="microbatches per step (not with --schedule)")
    p.add_argument("--algorithm", "-a", "--pp-algorithm", dest="algorithm", default=None,
                   help="primuspipe algorithm (see 'primuspipe list'; default 1f1b); --pp-algorithm as "
                        "examples/train_gpt.py")
    p.add_argument("--vpp", "--num-virtual-stages-per-pipeline-rank", dest="vpp", type=POSITIVE, default=None,
                   help="chunks per rank (default: the algorithm's)")
    p.add_argument("--schedule", default=None, help="run this table file (.json or torch .csv) instead")
    p.add_argument("--layers", type=POSITIVE, default=8)
    p.add_argument("--hidden", type=POSITIVE, default=64)
    p.add_argument("--microbatch-size", "--micro-batch-size", dest="microbatch_size", type=POSITIVE, default=4)
    p.add_argument("--iterations", type=POSITIVE, default=5)
    p.add_argument("--lr", type=number_type(minimum=0), default=0.05)
    p.add_argument("--compare-torch", action="store_true", help="also run torch.distributed.pipelining and compare")
    args = p.parse_args(argv)
    if args.schedule is not None:  # the table file fixes its shape and algorithm: a flag beside it would be ignored
        given = [flag for flag, value in (("--microbatches", args.microbatches), ("--algorithm", args.algorithm),
                                          ("--vpp", args.vpp)) if value is not None]
        if given:
            p.error(f"{given[0]} is what the --schedule table fixes; drop {given[0]}, or drop --schedule")
    elif args.microbatches is None:  # was refused on every rank after its process group
        p.error("give --microbatches (or --schedule)")
    args.algorithm = args.algorithm or "1f1b"
    return args


def make_model(args) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(),
                                                     torch.nn.LayerNorm(args.hidden)) for _ in range(args.layers)])


def plan(args: argparse.Namespace, world: int):
    """The table the run executes, settled with what it needs of ``world`` ranks and of the model before any
    process group: each refusal here was made after every rank had joined one (a --schedule table of another pp,
    fewer --layers than the table has stages)."""
    if world != args.pp:
        raise ConfigError(f"run with --nproc-per-node {args.pp} (got a world of {world})")
    table = load_table(args.schedule) if args.schedule else build_schedule(args.algorithm, args.pp, args.microbatches,
                                                                          args.vpp)
    if table.pp != args.pp:
        raise ConfigError(f"--schedule {args.schedule} is a table of pp={table.pp}; give --pp {table.pp} (and as many "
                          "processes)")
    if table.num_stages > args.layers:
        raise ConfigError(f"--layers {args.layers} cannot fill the table's {table.num_stages} stages (pp*vpp, each "
                          f"needs a layer); give --layers {table.num_stages} or more")
    return table


def main(argv=None) -> None:
    args = parse_args(argv)
    table = plan(args, int(os.environ.get("WORLD_SIZE", "1")))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else nccl_emulation.cpu_backend())
    device = torch.device("cuda") if cuda else torch.device("cpu")
    rank = dist.get_rank()

    def my_stages():
        stages = split_sequential(make_model(args).to(device), table.num_stages)
        return {s: stages[s] for s in table.placement.stages[rank]}

    stages = my_stages()
    loss_fn = torch.nn.functional.mse_loss
    pipe = TorchPipeline(table, stages, loss_fn=loss_fn, device=device)
    params = [p for module in stages.values() for p in module.parameters()]
    optimizer = torch.optim.SGD(params, lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    batch = args.microbatch_size * table.microbatches
    x = torch.randn(batch, args.hidden, generator=gen).to(device)
    y = torch.randn(batch, args.hidden, generator=gen).to(device)

    result: dict = {"algorithm": table.algorithm, "pp": table.pp, "vpp": table.vpp, "microbatches": table.microbatches}
    if args.compare_torch:
        result["max_abs_grad_diff_vs_torch"] = _compare_with_torch(table, my_stages(), pipe, x, y, loss_fn, device)
    losses, times = [], []
    for _ in range(args.iterations):
        optimizer.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        step_losses = pipe.step(x, target=y)
        times.append(time.perf_counter() - start)
        optimizer.step()
        if step_losses is not None:
            losses.append(torch.stack(step_losses).mean().item())
    result["losses"] = _from_last_stage(losses, table, rank)
    result["step_time_s"] = statistics.median(times)
    if rank == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


def _compare_with_torch(table, theirs, pipe, x, y, loss_fn, device) -> float:
    """The first step's gradients of primuspipe and of torch's runtime on the same table, weights, data."""
    from primuspipe.testing.torch_pipelining import torch_runtime, torch_step

    pipe.step(x, target=y)
    torch_step(torch_runtime(table, theirs, loss_fn, device=device), pipe.has_first_stage, pipe.has_last_stage, (x,), y)
    ours = [p.grad for module in pipe.modules for p in module.parameters()]
    other = [p.grad for s in sorted(theirs) for p in theirs[s].parameters()]
    diff = torch.tensor(max((a - b).abs().max().item() for a, b in zip(ours, other)), device=device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    for module in pipe.modules:
        module.zero_grad()
    return diff.item()


def _from_last_stage(losses: list[float], table, rank: int) -> list[float]:
    """The loss history, sent from the rank holding the last stage to rank 0."""
    box = [losses]
    dist.broadcast_object_list(box, src=table.placement.rank_of(table.num_stages - 1))
    return box[0]


def run_refusing_once(entry) -> None:
    """Run ``entry()``; a refusal (PrimusPipeError: every rank refuses the same input) is printed once, by
    rank 0, on one line, and every rank exits with status 1 -- not one traceback per rank."""
    try:
        entry()
    except PrimusPipeError as exc:
        if dist.is_initialized():
            dist.destroy_process_group()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {printable(str(exc).splitlines()[0])}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    run_refusing_once(main)
