"""PyTorch's FSDP2, run for real on two gloo ranks, copies each gathered unit and each unit's gradients once
more than the collectives themselves: what ``TrainingSpec.fsdp2_copies`` prices on the compute stream.

Each ``wait_for_unshard`` copies the all-gather buffer into the unit's parameters (``fsdp::split_with_sizes_copy``,
``foreach_all_gather_copy_out``): in its forward, and again before its backward where the unit was resharded after
the forward; the root unit (never resharded after the forward) and a block with ``reshard_after_forward=False``
once. Each unit's reduce-scatter first packs its bf16 gradients into the fp32 reduce buffer (``fsdp::chunk_cat``,
``foreach_reduce_scatter_copy_in``), once a backward. A torchtitan-shaped model (blocks wrapped alone, the last
one not resharded, the root over the rest; bf16 parameters, fp32 reduction) runs a step under the profiler and the
copies' sizes and dtypes are read from it. Which stream runs them a CPU run cannot show; the projection takes that
from the code (:attr:`~primuspipe.projection.training_spec.TrainingSpec.fsdp2_copies`)."""

from __future__ import annotations

import math

import torch
from emulation_limits import NO_DEVICE_MESH

from primuspipe.testing.gloo import run_gloo

BLOCKS, H, VOCAB = 3, 16, 48
BLOCK_PARAMS = 2 * H * 2 * H  # up and down, no bias
ROOT_PARAMS = 2 * VOCAB * H  # embedding and output layer


def _work(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.profiler import ProfilerActivity, profile

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(H, 2 * H, bias=False)
            self.down = torch.nn.Linear(2 * H, H, bias=False)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, H), *(Block() for _ in range(BLOCKS)),
                                torch.nn.Linear(H, VOCAB, bias=False))
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(list(model)[1:1 + BLOCKS]):  # torchtitan's apply_fsdp: the last block stays gathered
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < BLOCKS - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    tokens = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the second step is the one read: lazy initialisation is done
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model(tokens).float().sum().backward()
    copies: dict[str, list[tuple[int, str]]] = {"fsdp::split_with_sizes_copy": [], "fsdp::chunk_cat": []}
    for event in prof.events():
        if event.name in copies:  # the gathered buffer is the copy-out's first input, the packed one chunk_cat's out
            shape = event.input_shapes[0] if event.name == "fsdp::split_with_sizes_copy" else event.input_shapes[-1]
            dtype = event.input_dtypes[0] if event.name == "fsdp::split_with_sizes_copy" else event.input_dtypes[-1]
            copies[event.name].append((math.prod(shape), dtype))
    return copies


@NO_DEVICE_MESH
def test_fsdp2_copies_each_gathered_unit_and_each_units_gradients():
    for copies in run_gloo(_work, 2, timeout_s=240):
        copy_out, copy_in = copies["fsdp::split_with_sizes_copy"], copies["fsdp::chunk_cat"]
        assert {dtype for _, dtype in copy_out} == {"c10::BFloat16"}, "the gathered bf16 weights are copied"
        # the root once, every block in its forward, the resharded ones again before their backward
        assert sorted(n for n, _ in copy_out) == sorted([ROOT_PARAMS] + [BLOCK_PARAMS] * (BLOCKS + BLOCKS - 1))
        assert {dtype for _, dtype in copy_in} == {"float"}, "the gradients are packed into the fp32 reduce buffer"
        assert sorted(n for n, _ in copy_in) == sorted([ROOT_PARAMS] + [BLOCK_PARAMS] * BLOCKS)
