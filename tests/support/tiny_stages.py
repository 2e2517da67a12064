"""The tiny per-stage model the runner tests train: a Linear + Tanh per stage with fixed weights, a fixed
batch per microbatch, and a loss that weighs each microbatch differently (so swapped microbatches show)."""

import torch

H, BATCH = 6, 3


def stage(index: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(100 + index)
    layer = torch.nn.Linear(H, H)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(H, H, generator=gen) * 0.5)
        layer.bias.copy_(torch.randn(H, generator=gen) * 0.1)
    return torch.nn.Sequential(layer, torch.nn.Tanh())


def inputs(m: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH, H, generator=gen) for _ in range(m)]


def loss(out: torch.Tensor, mb: int) -> torch.Tensor:
    return (out * (mb + 1)).pow(2).mean()
