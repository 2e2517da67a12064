"""Layers a vendor package would define on top of Transformer Engine -- here on top of primuspipe's CPU
stand-in -- in a module of their own, so detection by inheritance (not module path) is what is tested.

``MegatronStyleLinear`` does what megatron-core's ``TELinear`` wrapper does around TE's ``Linear``: it
takes Megatron's builder arguments, passes ``config.delay_wgrad_compute`` and ``skip_bias_add``
(``return_bias``) to TE, feeds ``is_first_microbatch`` (true for its first forward) and returns
``(output, bias)``; its ``backward_dw`` runs only while ``config.delay_wgrad_compute`` is set.
"""

import torch

from primuspipe.testing import te_standin


class MegatronStyleLinear(te_standin.Linear):
    def __init__(self, input_size, output_size, *, config, bias=True, skip_bias_add=False, **_):
        super().__init__(input_size, output_size, bias=bias, return_bias=skip_bias_add and bias,
                         delay_wgrad_compute=config.delay_wgrad_compute)
        self.config = config
        self.is_first_microbatch = True

    def forward(self, x):
        out = super().forward(x, is_first_microbatch=self.is_first_microbatch)
        self.is_first_microbatch = False
        return out if self.return_bias else (out, None)

    def backward_dw(self):
        if self.config.delay_wgrad_compute:
            super().backward_dw()


class PrimusTurboLinear(MegatronStyleLinear):
    """Like Primus-Turbo's linears: inherits the TE wrapper, runs its own GEMM (weight gradient in B)."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class BypassingLinear(MegatronStyleLinear):
    """An unknown subclass whose forward bypasses TE's autograd function: caught at run time."""

    def forward(self, x, is_first_microbatch=None):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class TEFusedMLP(torch.nn.Module):
    """Named like megatron-core's TEFusedMLP (weights run through te.pytorch.ops)."""


class GroupedMLP(torch.nn.Module):
    """Named like megatron-core's legacy grouped_gemm experts."""


class TEGroupedMLP(torch.nn.Module):
    """Only *named* like Megatron's TE experts: not a TE module, so nothing to defer or refuse."""


class MegatronStyleGroupedLinear(te_standin.GroupedLinear):
    """What megatron-core's ``TEGroupedLinear`` does around TE's ``GroupedLinear`` (no biases here)."""

    def __init__(self, num_gemms, input_size, output_size, *, config, bias=False, **_):
        assert not bias, "the stand-in grouped linear has no biases"
        super().__init__(num_gemms, input_size, output_size, delay_wgrad_compute=config.delay_wgrad_compute)
        self.config = config

    def forward(self, x, m_splits):
        return super().forward(x, m_splits), None

    def backward_dw(self):
        if self.config.delay_wgrad_compute:
            super().backward_dw()
