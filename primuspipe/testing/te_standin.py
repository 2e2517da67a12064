"""A STAND-IN for Transformer Engine's deferred weight gradients, for CPU tests. It is not TE.

Transformer Engine cannot be imported without CUDA, so the CPU tests check primuspipe's side of the
contract against this module, written from TE's source semantics (``transformer_engine/pytorch/module``,
TE >= 2.3) and nothing more; the GPU tests (``tests/megatron/test_te_gpu.py``) check the real thing.
What it reproduces, and where TE does it:

* ``WeightGradStore`` (``module/_common.py``): one FIFO per module; ``put`` appends ``(tensors, gemm)``,
  ``pop`` runs the oldest and returns ``(gemm result, tensors)``, an empty ``pop`` raises.
* ``TransformerEngineBaseModule`` (``module/base.py``): ``wgrad_store`` is ``None`` on modules without a
  weight GEMM (attention); ``backward_dw`` pops, *assigns* ``weight.grad`` (it does not accumulate)
  unless ``fuse_wgrad_accumulation``, assigns the bias gradient only if ``bias.grad is None``, then runs
  the hooks registered with ``register_wgrad_accumulation_and_reduce_hooks`` (Megatron DDP's, with
  ``ddp_config.delay_wgrad_compute``).
* ``Linear`` (``module/linear.py``): with ``delay_wgrad_compute`` its parameters carry
  ``skip_backward_post_hook``; the backward computes the input gradient, and the weight GEMM -- fused
  with the bias gradient -- goes to the store; with ``return_bias`` (Megatron's ``skip_bias_add``) the
  bias is returned, its gradient comes through autograd in the backward and the deferred GEMM has none,
  so ``backward_dw`` on a module whose ``bias.grad`` is ``None`` fails as TE's does (``None.to``); under ``fuse_wgrad_accumulation`` the GEMM writes into
  ``main_grad``, overwriting it when the forward had ``is_first_microbatch=True``, and the backward
  returns a dummy weight gradient with ``grad_added_to_main_grad`` set.
* ``LayerNormMLP`` (``module/layernorm_mlp.py``): two GEMMs, two ``put`` per backward (fc2's first),
  two ``pop`` per ``backward_dw``.
* ``GroupedLinear`` (``module/grouped_linear.py``): one ``put`` for all its GEMMs; its ``backward_dw``
  returns silently on an empty queue (which is why primuspipe counts entries itself).
* ``DotProductAttention``: a TE base module without weights.

The class names are TE's, because primuspipe recognises TE modules by the names of the classes they
inherit from (``te_deferral``), never by module path.
"""

from __future__ import annotations

import queue

import torch


class WeightGradStore:
    """TE's per-module FIFO of deferred weight-gradient GEMMs."""

    def __init__(self, delay_wgrad_compute: bool = False):
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = delay_wgrad_compute

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensor_list, func) -> None:
        assert self.enabled, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        assert self.enabled, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        raise RuntimeError("Pop empty queue.")


class TransformerEngineBaseModule(torch.nn.Module):
    """TE's base module: the deferred-weight-gradient half of it."""

    def __init__(self):
        super().__init__()
        self.wgrad_store = None
        self.wgrad_accumulation_and_reduce_hooks = []
        self.fuse_wgrad_accumulation = False
        self.use_bias = False

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        (wgrad, bgrad), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            self.weight.grad = wgrad.to(self.weight.dtype)
        if self.use_bias and self.bias.grad is None:
            self.bias.grad = bgrad.to(self.bias.dtype)
        self._trigger_hooks()

    def _trigger_hooks(self) -> None:
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


def _mark_deferred(module: torch.nn.Module) -> None:
    """TE marks a deferring module's parameters so Megatron DDP hooks the module, not the parameter."""
    for param in module.parameters(recurse=False):
        param.skip_backward_post_hook = True


def _weight_gemm(x, dy, weight, accumulate: bool, fuse: bool, with_bias: bool):
    """TE's ``wgrad_gemm`` closure: ``dw = dy^T x`` (into ``main_grad`` when fused), ``db`` fused."""
    dw = dy.t().matmul(x)
    db = dy.sum(0) if with_bias else None
    if not fuse:
        return dw, db
    if accumulate:
        weight.main_grad.add_(dw)
    else:
        weight.main_grad.copy_(dw)
    return None, db


def _returned_weight_grad(weight, fuse: bool):
    """What TE's backward returns for the weight when its GEMM was deferred."""
    if fuse and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)
    return None


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, is_first_microbatch):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.param, ctx.has_bias = module, weight, bias is not None
        ctx.accumulate = module.fuse_wgrad_accumulation and not is_first_microbatch \
            if is_first_microbatch is not None else module.fuse_wgrad_accumulation
        out = x.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        module = ctx.module
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = dy.matmul(weight)
        fuse = module.fuse_wgrad_accumulation
        param = ctx.param

        def gemm(inp, grad):
            return _weight_gemm(inp, grad, param, ctx.accumulate, fuse, ctx.has_bias)

        if module.need_backward_dw():
            module.wgrad_store.put([x2, dy2], gemm)
            return dx, _returned_weight_grad(param, fuse), None, None, None
        dw, db = gemm(x2, dy2)
        if fuse:
            dw = _returned_weight_grad(param, fuse)
        return dx, dw, db, None, None


class Linear(TransformerEngineBaseModule):
    """Stand-in for ``transformer_engine.pytorch.Linear`` (the parts deferral touches)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, return_bias: bool = False,
                 delay_wgrad_compute: bool = False, fuse_wgrad_accumulation: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        self.use_bias = bias
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        if delay_wgrad_compute:
            _mark_deferred(self)

    def forward(self, x, is_first_microbatch=None):
        if self.return_bias:  # the bias leaves the GEMM: its gradient reaches it through autograd, in B
            return _LinearFunction.apply(x, self.weight, None, self, is_first_microbatch), self.bias
        return _LinearFunction.apply(x, self.weight, self.bias, self, is_first_microbatch)


class LayerNormMLP(TransformerEngineBaseModule):
    """Stand-in for ``transformer_engine.pytorch.LayerNormMLP``: norm, fc1, GELU, fc2 (no biases), two
    deferred GEMMs per backward (fc2's first), both popped by one ``backward_dw``."""

    def __init__(self, hidden: int, ffn: int, *, delay_wgrad_compute: bool = False):
        super().__init__()
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(hidden))
        self.fc1_weight = torch.nn.Parameter(torch.randn(ffn, hidden) / hidden ** 0.5)
        self.fc2_weight = torch.nn.Parameter(torch.randn(hidden, ffn) / ffn ** 0.5)
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        if delay_wgrad_compute:
            self.fc1_weight.skip_backward_post_hook = self.fc2_weight.skip_backward_post_hook = True

    def forward(self, x, is_first_microbatch=None):
        normed = torch.nn.functional.layer_norm(x, x.shape[-1:], self.layer_norm_weight)
        hidden = torch.nn.functional.gelu(_LinearFunction.apply(normed, self.fc1_weight, None, self, is_first_microbatch))
        return _LinearFunction.apply(hidden, self.fc2_weight, None, self, is_first_microbatch)

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        (fc2_wgrad, _), _ = self.wgrad_store.pop()
        (fc1_wgrad, _), _ = self.wgrad_store.pop()
        self.fc2_weight.grad = fc2_wgrad
        self.fc1_weight.grad = fc1_wgrad
        self._trigger_hooks()


class _GroupedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, module, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.m_splits, ctx.module = m_splits, module
        return torch.cat([part.matmul(w.t()) for part, w in zip(x.split(m_splits), weights)])

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        pairs = list(zip(x.split(ctx.m_splits), dy.split(ctx.m_splits)))
        dx = torch.cat([g.matmul(w) for (_, g), w in zip(pairs, weights)])

        def gemm(pairs_):
            return [g.t().matmul(inp) for inp, g in pairs_], None

        if ctx.module.need_backward_dw():
            ctx.module.wgrad_store.put([pairs], gemm)
            return (dx, None, None, *(None for _ in weights))
        dws, _ = gemm(pairs)
        return (dx, None, None, *dws)


class GroupedLinear(TransformerEngineBaseModule):
    """Stand-in for ``transformer_engine.pytorch.GroupedLinear`` (no biases): ``num_gemms`` weights
    ``weight0..``; rows of the input split by ``m_splits``; one deferred entry per backward."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, delay_wgrad_compute: bool = False):
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features)
                                                                     / in_features ** 0.5))
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        if delay_wgrad_compute:
            _mark_deferred(self)

    def forward(self, x, m_splits):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        return _GroupedFunction.apply(x, list(m_splits), self, *weights)

    def backward_dw(self) -> None:
        if not self.need_backward_dw() or self.wgrad_store.context.empty():
            return
        (wgrads, _), _ = self.wgrad_store.pop()
        for i, wgrad in enumerate(wgrads):
            getattr(self, f"weight{i}").grad = wgrad
        self._trigger_hooks()


class DotProductAttention(TransformerEngineBaseModule):
    """Stand-in for TE's attention: a base module with no weights (nothing to defer)."""

    def forward(self, q, k, v):
        scores = q.matmul(k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return scores.softmax(-1).matmul(v)
