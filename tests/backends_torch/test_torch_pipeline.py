"""TorchPipeline beyond the plain model: tuples of tensors between stages (an integer tensor among
them, across ranks and across a V-shape's same-rank hand-off), several inputs, eval, unscaled
gradients, timelines, data parallelism under DDP and FSDP2 (pp 2 x dp 2), and one-line refusals."""

import torch
import torch.distributed as dist

from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.torch import TorchPipeline, split_sequential
from primuspipe.errors import ConfigError
from primuspipe.io.timeline import dump_iterations
from primuspipe.testing.gloo import run_gloo
from primuspipe.testing.torch_pipelining import mse, plain_model, sequential_reference
from emulation_limits import NO_DEVICE_MESH

H = 8


class Head(torch.nn.Module):
    """Two inputs in, a hidden state and an integer position tensor out."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x, scale):
        return torch.tanh(self.lin(x) * scale), torch.arange(x.shape[0]).repeat_interleave(2).view(-1, 2)


class Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, h, pos):
        return torch.tanh(self.lin(h)) + 0.01 * pos[:, :1].float(), pos


class Tail(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, h, pos):
        return self.lin(h) * (1 + pos[:, 1:].float())


def _tuple_stages(num_stages):
    torch.manual_seed(3)
    return [Head()] + [Body() for _ in range(num_stages - 2)] + [Tail()]


def _batch(n=8):
    gen = torch.Generator().manual_seed(5)
    return torch.randn(n, H, generator=gen), torch.rand(n, 1, generator=gen) + 0.5, torch.randn(n, H, generator=gen)


def test_tuples_between_stages_and_several_inputs(tmp_path):
    x, scale, y = _batch()
    cases = {alg: build_schedule(alg, 2, 4, vpp) for alg, vpp in (("zbv", 2), ("zb-h1", 1), ("dualpipe-v", 2))}

    def work(rank, world):
        out = {}
        for alg, table in cases.items():
            stages = _tuple_stages(table.num_stages)
            mine = {s: stages[s] for s in table.placement.stages[rank]}
            pipe = TorchPipeline(table, mine, loss_fn=mse, watchdog_timeout_s=60, dump_dir=str(tmp_path / alg))
            losses = pipe.step(x, scale, target=y)
            evaluated = pipe.eval(x, scale)
            out[alg] = (losses, evaluated, {s: [p.grad for p in m.parameters()] for s, m in mine.items()})
        return out

    results = run_gloo(work, 2)
    for alg, table in cases.items():
        stages = _tuple_stages(table.num_stages)
        want_losses, outputs = [], []
        for xs, ss, ys in zip(x.tensor_split(4), scale.tensor_split(4), y.tensor_split(4)):
            value = (xs, ss)
            for stage in stages:
                value = stage(*value)
            outputs.append(value.detach())
            loss = mse(value, ys)
            loss.backward()
            want_losses.append(loss.detach())
        last = table.placement.rank_of(table.num_stages - 1)
        losses, evaluated, _ = results[last][alg]
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses))
        torch.testing.assert_close(evaluated.output, torch.cat(outputs))
        assert evaluated.losses is None, "no target: outputs only"
        assert dump_iterations(tmp_path / alg) == [0], "a step sending tuples is dumped (their bytes summed)"
        got = {s: g for r in results for s, g in r[alg][2].items()}
        for s, stage in enumerate(stages):
            for g, p in zip(got[s], stage.parameters()):
                torch.testing.assert_close(g, p.grad / 4, rtol=1e-5, atol=1e-7, msg=f"{alg} stage {s}")


def test_one_rank_unscaled_gradients_timelines_and_refusals(tmp_path):
    x, _, y = _batch()
    table = build_schedule("1f1b", 1, 4)

    def work(rank, world):
        model = plain_model(H, layers=2)
        pipe = TorchPipeline(table, {0: model}, loss_fn=mse, scale_grads=False, dump_dir=str(tmp_path))
        pipe.step(x, target=y)
        grads = [p.grad.clone() for p in model.parameters()]
        scaled = TorchPipeline(table, {0: model}, loss_fn=mse)

        def refused(attempt, zero=True):
            if zero:
                model.zero_grad()
            try:
                attempt()
            except ConfigError as exc:
                return str(exc)
            return "no error"

        refusals = [refused(lambda: scaled.step(x, target=y), zero=False),  # stale gradients, scaled
                    refused(lambda: TorchPipeline(table, {1: model}, loss_fn=mse)),  # another rank's stage
                    refused(lambda: TorchPipeline(build_schedule("1f1b", 2, 4), {0: model})),  # pp != world
                    refused(lambda: TorchPipeline(table, {0: model}).step(x, target=y)),  # no loss function
                    refused(lambda: pipe.step(x[:3], target=y[:3])),  # a batch smaller than m
                    refused(lambda: pipe.step(x[:4], target=y[:4])),  # not the first step's shapes
                    refused(lambda: pipe.step(target=y))]  # no inputs on the first stage
        with torch.no_grad():
            refusals.append(refused(lambda: pipe.step(x, target=y)))
        return grads, refusals

    ((grads, refusals),) = run_gloo(work, 1)
    _, want = sequential_reference(plain_model(H, layers=2), x, y, 4)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, 4 * w, msg="scale_grads=False keeps the sum over microbatches")
    assert dump_iterations(tmp_path) == [0], "the step wrote its timeline"
    expected = ["already holds a gradient", "holds stages [0]", "pp=2 ranks", "needs a loss_fn",
                "fewer than the table's 4 microbatches", "inferred at the first step", "needs the inputs",
                "torch.no_grad"]
    assert len(refusals) == len(expected)
    for message, want_text in zip(refusals, expected):
        assert want_text in message, message


def _data_parallel_run(wrap: str, algorithms):
    """pp 2 x dp 2 on four processes; each replica trains on its half of the batch. Returns, per
    algorithm and rank, how many gradient reductions (DDP bucket all-reduces, FSDP reduce-scatters)
    the step ran and how many stages the rank holds."""
    gen = torch.Generator().manual_seed(11)
    x, y = torch.randn(16, H, generator=gen), torch.randn(16, H, generator=gen)
    tables = {alg: build_schedule(alg, 2, 4, vpp) for alg, vpp in algorithms}

    def work(rank, world):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        reductions = [0]

        def counted(fn):
            def wrapper(*args, **kwargs):
                reductions[0] += 1
                return fn(*args, **kwargs)
            return wrapper

        def counted_allreduce(state, bucket):  # DDP checks a comm hook's parameter names
            reductions[0] += 1
            return allreduce_hook(state, bucket)

        dist.reduce_scatter_single = counted(dist.reduce_scatter_single)  # what FSDP2 reduces with
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp_group, dp_rank = mesh["pp"].get_group(), mesh["dp"].get_local_rank()
        pp_rank = dist.get_rank(pp_group)
        out = {}
        for alg, table in tables.items():
            stages = split_sequential(plain_model(H), table.num_stages)
            mine = {}
            for s in table.placement.stages[pp_rank]:
                if wrap == "ddp":
                    mine[s] = torch.nn.parallel.DistributedDataParallel(stages[s], process_group=mesh["dp"].get_group())
                    mine[s].register_comm_hook(mesh["dp"].get_group(), counted_allreduce)
                else:
                    mine[s] = fully_shard(stages[s], mesh=mesh["dp"])
            pipe = TorchPipeline(table, mine, loss_fn=mse, group=pp_group, watchdog_timeout_s=60)
            half = slice(8 * dp_rank, 8 * dp_rank + 8)
            reductions[0] = 0
            pipe.step(x[half], target=y[half])
            grads = {s: [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in m.parameters()]
                     for s, m in mine.items()}
            out[alg] = grads, reductions[0]
        return out

    results = run_gloo(work, 4, timeout_s=240)
    halves = [sequential_reference(plain_model(H), x[8 * d:8 * d + 8], y[8 * d:8 * d + 8], 4)[1] for d in range(2)]
    want = [(a + b) / 2 for a, b in zip(*halves)]
    for alg, table in tables.items():
        for replica in (results[0::2], results[1::2]):  # ranks (0, 2) and (1, 3): pp ranks 0 and 1 of a replica
            got = {s: g for r in replica for s, g in r[alg][0].items()}
            flat = [g for s in range(table.num_stages) for g in got[s]]
            for g, w in zip(flat, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=f"{wrap} {alg}")
        assert all(r[alg][1] == table.vpp for r in results), f"{wrap} {alg}: one reduction per stage and step"


@NO_DEVICE_MESH
def test_ddp_stages_reduce_once_per_step():
    _data_parallel_run("ddp", [("1f1b", 1), ("zbv", 2)])


@NO_DEVICE_MESH
def test_fsdp2_stages_reduce_scatter_once_per_step():
    _data_parallel_run("fsdp", [("interleaved-1f1b", 2), ("zbv", 2)])
