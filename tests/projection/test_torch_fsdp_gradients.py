"""PyTorch's FSDP2, run for real on two gloo ranks, makes a step's gradients only in its backward.

The projection leaves the gradients out of the activations' peak under ``fsdp_implementation: torch`` with
one microbatch a step (``TrainingSpec.gradients_from_backward``): torchtitan calls ``optimizer.zero_grad()``
(``set_to_none=True``) as each step begins, and ``fully_shard`` gives a layer's parameters their sharded
gradient only when that layer's reduce-scatter is done. Here a torchtitan-shaped model (embedding, blocks
each wrapped alone, the last one not resharded after forward, the root wrapped over the rest, bf16
parameters with fp32 reduction) trains two steps and records, in the second, which blocks hold a gradient
when the loss is made and as each block's backward begins."""

from __future__ import annotations

import torch
import torch.distributed as dist
from emulation_limits import NO_DEVICE_MESH

from primuspipe.testing.gloo import run_gloo

BLOCKS, H, VOCAB = 3, 16, 32


def _work(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, H), *(Block() for _ in range(BLOCKS)),
                                torch.nn.RMSNorm(H), torch.nn.Linear(H, VOCAB))
    blocks = list(model)[1:1 + BLOCKS]
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):  # torchtitan's apply_fsdp: the last block stays gathered for the backward
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < BLOCKS - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))

    def holding() -> list[bool]:
        return [all(p.grad is not None for p in b.parameters()) for b in blocks]

    seen: dict[str, list[bool]] = {}
    for step in range(2):
        optimizer.zero_grad()
        if step:
            for i, block in enumerate(blocks):
                block.register_full_backward_pre_hook(lambda *_, i=i: seen.setdefault(f"block {i}", holding()) and None)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        if step:
            seen["loss"] = [p.grad is not None for p in model.parameters()]
        loss.backward()
        optimizer.step()
    dtypes = {p.grad.dtype for p in model.parameters()}
    return seen, holding(), dtypes


@NO_DEVICE_MESH
def test_fsdp2_gradients_appear_layer_by_layer_in_the_backward():
    for seen, after, dtypes in run_gloo(_work, 2, timeout_s=240):
        assert not any(seen["loss"]), "no gradient while the forward's activations are all there"
        assert seen[f"block {BLOCKS - 1}"] == [False] * BLOCKS  # the first block to run its backward
        assert seen["block 0"] == [False] + [True] * (BLOCKS - 1), "each later block's shard came with its backward"
        assert after == [True] * BLOCKS
        assert dtypes == {torch.float32}, "the sharded gradients are the fp32 parameters' (4 bytes)"
