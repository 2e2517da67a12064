"""The acceptance matrix: every algorithm on a plain 8-layer model through the torch backend, on real
gloo processes at pp 2 and 4, gives the losses and gradients of one process, and exactly (bit for bit)
those of torch.distributed.pipelining's runtime running the same table from primuspipe's CSV with
default settings. That CSV also trains like torch's own schedule classes. One launch per pipeline size
runs every case."""

import pytest
import torch

from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.torch import TorchPipeline, split_sequential
from primuspipe.testing.gloo import run_gloo
from emulation_limits import TORCH_RUNTIME_HANGS
from primuspipe.testing.torch_pipelining import (
    local_stage_indices, mse, plain_model, sequential_reference, torch_runtime, torch_schedule, torch_step,
)

ALGORITHMS = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("v-half", 2), ("dualpipe-v", 2),
              ("zb-auto", 1)]
TORCH_TWINS = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
               ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"), ("zbv", 2, "ScheduleZBVZeroBubble"),
               ("dualpipe-v", 2, "ScheduleDualPipeV")]
HIDDEN = 32


def _data(m: int):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2 * m, HIDDEN, generator=gen), torch.randn(2 * m, HIDDEN, generator=gen)


def _grads(modules):
    return {s: [p.grad.clone() for p in mod.parameters()] for s, mod in modules.items()}


def _run_all(pp: int, m: int):
    x, y = _data(m)
    tables = {alg: build_schedule(alg, pp, m, vpp) for alg, vpp in ALGORITHMS}
    twins = {alg: build_schedule(alg, pp, m, vpp) for alg, vpp, _ in TORCH_TWINS}

    def modules(num_stages, stages):
        cut = split_sequential(plain_model(HIDDEN), num_stages)
        return {s: cut[s] for s in stages}

    def work(rank, world):
        out = {}
        for alg, table in tables.items():
            ours = modules(table.num_stages, table.placement.stages[rank])
            pipe = TorchPipeline(table, ours, loss_fn=mse, watchdog_timeout_s=60)
            losses = pipe.step(x, target=y)
            evaluated = pipe.eval(x, target=y)
            theirs = modules(table.num_stages, table.placement.stages[rank])
            torch_losses = torch_step(torch_runtime(table, theirs, mse), pipe.has_first_stage, pipe.has_last_stage,
                                      (x,), y)
            out[alg] = (losses, evaluated and evaluated.losses, torch_losses, _grads(ours), _grads(theirs))
        for alg, _, name in TORCH_TWINS:
            table = twins[alg]
            csv_run = modules(table.num_stages, table.placement.stages[rank])
            torch_step(torch_runtime(table, csv_run, mse), 0 in csv_run, table.num_stages - 1 in csv_run, (x,), y)
            own = modules(table.num_stages, local_stage_indices(name, pp, table.vpp, rank))
            torch_step(torch_schedule(name, own, table.num_stages, m, mse), 0 in own, table.num_stages - 1 in own, (x,), y)
            out[name] = (_grads(csv_run), _grads(own))
        return out

    return tables, run_gloo(work, pp, timeout_s=300)


@TORCH_RUNTIME_HANGS
@pytest.mark.parametrize("pp", [2, 4])
def test_every_algorithm_equals_one_process_and_torch_runtime(pp):
    m = 2 * pp
    x, y = _data(m)
    want_losses, want_grads = sequential_reference(plain_model(HIDDEN), x, y, m)
    tables, results = _run_all(pp, m)
    for alg, table in tables.items():
        last = table.placement.rank_of(table.num_stages - 1)
        losses, eval_losses, torch_losses, _, _ = results[last][alg]
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=0, atol=0, msg=alg)
        torch.testing.assert_close(torch.stack(eval_losses), torch.stack(want_losses), rtol=0, atol=0, msg=alg)
        assert all(torch.equal(a, b) for a, b in zip(losses, torch_losses)), alg
        ours = {s: g for r in results for s, g in r[alg][3].items()}
        theirs = {s: g for r in results for s, g in r[alg][4].items()}
        flat = [g for s in range(table.num_stages) for g in ours[s]]
        assert len(flat) == len(want_grads)
        for got, want in zip(flat, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"{alg}: vs one process")
        for s in ours:
            assert all(torch.equal(a, b) for a, b in zip(ours[s], theirs[s])), f"{alg}: stage {s} vs torch runtime"
    for _, _, name in TORCH_TWINS:
        csv_run = {s: g for r in results for s, g in r[name][0].items()}
        own = {s: g for r in results for s, g in r[name][1].items()}
        assert csv_run.keys() == own.keys()
        for s in own:
            for a, b in zip(csv_run[s], own[s]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{name}: primuspipe CSV in torch vs torch's own")
