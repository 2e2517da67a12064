"""What PyTorch's DTensor tensor parallelism (torchtitan's ``apply_tp`` plan for the attention input: a
``SequenceParallel`` norm, ``PrepareModuleInput`` Shard(1) -> Replicate, ``ColwiseParallel`` wq, wk, wv) saves for
the backward and which collectives the backward runs, on two CPU ranks over gloo."""

from __future__ import annotations

import os


def probe(rank: int, world: int, port: int, results) -> None:
    """Rank ``rank``'s run; rank 0 puts (row counts of the 2-D tensors autograd saved, the backward's collectives)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, SequenceParallel,
                                                   parallelize_module)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Attention(torch.nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.wq = torch.nn.Linear(h, h, bias=False)
            self.wk = torch.nn.Linear(h, h // 4, bias=False)
            self.wv = torch.nn.Linear(h, h // 4, bias=False)

        def forward(self, x):
            return self.wq(x).sum() + self.wk(x).sum() + self.wv(x).sum()

    class Block(torch.nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.norm = torch.nn.RMSNorm(h)
            self.attention = Attention(h)

        def forward(self, x):
            return self.attention(self.norm(x))

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and "wait" not in str(func) and "wrap" not in str(func):
                self.names.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (world,))
    batch, seq, h = 2, 8, 32
    block = Block(h)
    parallelize_module(block, mesh, {
        "norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel()})
    x = DTensor.from_local(torch.randn(batch, seq // world, h, requires_grad=True), mesh, [Shard(1)])
    rows = []

    def pack(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.dim() == 2 and local.shape[1] == h and local.shape[0] != h:  # a linear's flattened input
            rows.append(local.shape[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = block(x)
    backward = Collectives()
    with backward:
        loss.full_tensor().backward() if isinstance(loss, DTensor) else loss.backward()
    if rank == 0:
        results.put((rows, backward.names))
    dist.destroy_process_group()
