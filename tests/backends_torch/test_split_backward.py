"""B then W gives the fused backward's gradients with the fused backward's work: no input gradient
is computed twice (counted in FLOPs with torch's own counter), and parameters accumulate through
autograd, so gradient hooks fire as after a fused backward."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from primuspipe.backends.torch.split_backward import backward_input

H = 16


class TwoOutputs(torch.nn.Module):
    """A hidden state and an output only a parameter affects (no input does)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.GELU(), torch.nn.LayerNorm(H), torch.nn.Linear(H, H))
        self.scale = torch.nn.Parameter(torch.ones(H))

    def forward(self, x):
        return self.body(x), self.scale * 3


class SharedWeight(torch.nn.Module):
    """One linear layer used twice, with an input-gradient path between the two uses."""

    def __init__(self):
        super().__init__()
        self.shared, self.middle = torch.nn.Linear(H, H), torch.nn.Linear(H, H)

    def forward(self, x):
        return (self.shared(torch.tanh(self.middle(self.shared(x)))),)


def _block():
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.GELU(), torch.nn.LayerNorm(H), torch.nn.Linear(H, H))


def _backward(module, x0, split, input_grad):
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(input_grad)
    out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.full_like(o, 0.5) for o in outs]
    with FlopCounterMode(display=False) as flops:
        if split:
            input_grads, deferred = backward_input(outs, grads, [x] if input_grad else [])
            dx = input_grads[0] if input_grad else None
            b_flops = flops.get_total_flops()
            deferred.run()
        else:
            torch.autograd.backward(outs, grads)
            dx, b_flops = x.grad, None
    return dx, [p.grad for p in module.parameters()], b_flops, flops.get_total_flops()


@pytest.mark.parametrize("make, input_grad", [(_block, True), (_block, False), (TwoOutputs, True)],
                         ids=["middle-stage", "first-stage", "param-only-output"])
def test_b_plus_w_is_the_fused_backward_exactly(make, input_grad):
    torch.manual_seed(0)
    module, x = make(), torch.randn(8, H)
    dx, grads, b_flops, bw_split = _backward(module, x, True, input_grad)
    dx_ref, grads_ref, _, bw_fused = _backward(module, x, False, input_grad)
    assert bw_split == bw_fused, "B + W do the fused backward's work, no more"
    if input_grad:
        torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
        gemm = 2 * 8 * H * H
        assert b_flops == 2 * gemm, "B: the two input-gradient GEMMs only"
    else:
        assert dx is None and b_flops == 0, "a first stage's B has nothing to compute; its W is the backward"
    for g, ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_a_parameter_used_twice_gets_its_gradient_once():
    torch.manual_seed(0)
    module, x = SharedWeight(), torch.randn(8, H)
    dx, grads, _, _ = _backward(module, x, True, True)
    dx_ref, grads_ref, _, _ = _backward(module, x, False, True)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    for g, ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-7)


def test_w_accumulates_through_autograd_so_gradient_hooks_fire():
    torch.manual_seed(0)
    module, x = _block(), torch.randn(8, H)
    fired = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x.requires_grad_()
    (_,), deferred = backward_input([module(x)], [torch.ones(8, H)], [x])
    assert fired == [], "B leaves the parameters alone"
    deferred.run()
    assert sorted(fired) == sorted(n for n, _ in module.named_parameters())
