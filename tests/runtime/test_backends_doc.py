"""docs/backends.md's 50-line backend runs as written: its code block, executed on two gloo ranks,
gives the gradients of one sequential model."""

import re
from pathlib import Path

import pytest
import torch

from primuspipe.testing.gloo import run_gloo

DOC = Path(__file__).resolve().parents[2] / "docs" / "backends.md"
H, BATCH, M = 4, 2, 4


def _doc_code() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return code


def _stage(stage: int) -> torch.nn.Module:
    torch.manual_seed(stage)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh())


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.mark.parametrize("algorithm,vpp", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_documented_backend_trains_like_one_model(algorithm, vpp):
    inputs = [torch.randn(BATCH, H, generator=torch.Generator().manual_seed(i)) for i in range(M)]

    def work(rank, world):
        namespace: dict = {}
        exec(_doc_code(), namespace)
        chunks = [_stage(c * world + rank) for c in range(vpp)]
        losses = namespace["train_step"](chunks, inputs, _loss, (BATCH, H), algorithm=algorithm, vpp=vpp)
        return {c * world + rank: [p.grad for p in ch.parameters()] for c, ch in enumerate(chunks)}, losses

    results = run_gloo(work, 2)
    stages = [_stage(s) for s in range(2 * vpp)]
    for x in inputs:
        for s in stages:
            x = s(x)
        _loss(x).backward()
    got = {s: g for grads, _ in results for s, g in grads.items()}
    for s, stage in enumerate(stages):
        for g, p in zip(got[s], stage.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-6)
