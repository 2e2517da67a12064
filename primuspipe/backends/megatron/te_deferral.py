"""Weight-gradient deferral through Transformer Engine's own store: ``W`` nodes for TE layers.

Transformer Engine (>= 2.3) modules with a weight GEMM -- ``Linear``, ``LayerNormLinear``,
``LayerNormMLP``, ``GroupedLinear`` (Megatron's ``TELinear``, ``TEColumnParallelLinear``,
``TERowParallelLinear``, ``TELayerNormColumnParallelLinear``, and ``TEGroupedMLP``'s
``TE*ParallelGroupedLinear`` experts) -- built with ``delay_wgrad_compute=True`` compute only the input
gradient in their backward and put the weight GEMM (a closure over the saved input and output gradient,
with the forward's ``is_first_microbatch`` and ``main_grad`` fusion settings) in a per-module FIFO,
``module.wgrad_store``; ``module.backward_dw()`` runs the oldest one, assigns the gradient and calls the
hooks Megatron DDP registered on the module (``ddp_config.delay_wgrad_compute``), which add it to
``main_grad``. megatron-core itself calls ``backward_dw`` only in its combined 1F1B
(``overlap_moe_expert_parallel_comm``), right after the same microbatch's backward.

Here the table decides (:class:`TEDeferral`, driven by the binder through the weight-gradient store):

* ``B`` runs Megatron's backward; every deferring module of the chunk that ran puts its GEMM(s) in its
  queue; we count them per module (``qsize`` before and after) and label them with the microbatch;
* ``W`` calls ``backward_dw`` on those modules until exactly that many entries are gone -- after
  checking that the oldest entries are this microbatch's (TE's queues carry no label; the table rule
  :mod:`primuspipe.passes.fifo_weight_grads` proves it up front, this catches anything else);
* a fused ``BW`` does both at once (the parameters are hooked through ``backward_dw`` only, so a
  backward not followed by it would lose the gradient);
* the step ends with every queue empty, else :class:`~primuspipe.errors.WeightGradError`.

A module that ran forward in a ``B``'s microbatch but deferred nothing (a subclass whose forward
bypasses TE's autograd functions, or a patched ``WeightGradStore``) is an error naming it: its weight
gradient was computed inside ``B`` and its ``W`` would be empty.

TE modules are recognised by the names of the classes they inherit from (``TransformerEngineBaseModule``
and the four GEMM classes), never by module path, so Primus-Turbo's and any user subclass are seen for
what they are. Which models cannot defer, and why, is :func:`plan_te_deferral`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from primuspipe.errors import ConfigError, WeightGradError

TE_BASE = "TransformerEngineBaseModule"
TE_WEIGHT_GEMMS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
"""TE's module classes with a weight GEMM (each builds a ``WeightGradStore``)."""

_BYPASSING = {
    "TEFusedMLP": "runs its layers' weights through Transformer Engine's fused operations (te.pytorch.ops), not "
                  "through the modules whose store backward_dw drains",
    "FusibleOperation": "is a Transformer Engine fused operation, which computes its weight gradient inside its "
                        "backward",
    "GroupedMLP": "computes the experts' weight gradients inside the grouped_gemm library's backward (legacy "
                  "moe_grouped_gemm without Transformer Engine)",
}
"""MRO class name -> why such a module's weight gradient cannot be deferred."""

PRIMUS_TURBO_PREFIX = "PrimusTurbo"
"""Primus-Turbo's Megatron classes (``PrimusTurboLinear``, ``PrimusTurbo*ParallelLinear``,
``PrimusTurbo*GroupedLinear``) subclass Megatron's TE wrappers but run Primus-Turbo's GEMM ops in their
own forward: under Primus's zero-bubble settings the weight GEMM goes to Primus's zero-bubble
``WeightGradStore`` (``zbpp_gemm.gemm_with_weight_gradient_store``), otherwise it runs inside the
backward -- never into the TE store they inherit."""


def _class_names(module: torch.nn.Module) -> list[str]:
    return [cls.__name__ for cls in type(module).__mro__]


def te_weight_gemm(module: torch.nn.Module) -> str | None:
    """The TE GEMM class ``module`` inherits from (``"Linear"``, ...), or ``None``."""
    for cls in type(module).__mro__:
        if cls.__name__ in TE_WEIGHT_GEMMS and any(base.__name__ == TE_BASE for base in cls.__mro__):
            return cls.__name__
    return None


def defers(module: torch.nn.Module) -> bool:
    """TE's own test (``need_backward_dw``): the module's store is on."""
    store = getattr(module, "wgrad_store", None)
    return store is not None and bool(store.delay_wgrad_compute())


def _describe(name: str, module: torch.nn.Module) -> str:
    return f"{name or 'the model'} ({' -> '.join(_class_names(module)[:4])})"


def _refusal(name: str, module: torch.nn.Module, split: bool) -> str | None:
    """Why ``module`` cannot run with this table, or ``None``."""
    names = _class_names(module)
    for cls, why in _BYPASSING.items():
        if split and cls in names:
            return f"{_describe(name, module)} {why}"
    gemm = te_weight_gemm(module)
    if gemm is None:
        return None
    if any(n.startswith(PRIMUS_TURBO_PREFIX) for n in names):
        if split or defers(module):
            return (f"{_describe(name, module)} is a Primus-Turbo layer: it inherits TE's {gemm} (and its store) but "
                    "its forward runs Primus-Turbo's GEMM ops, whose weight gradient is computed in the backward or "
                    "put in Primus's own zero-bubble WeightGradStore, which primuspipe does not drive; build that "
                    "layer with Transformer Engine's class (Primus's TE spec with the Primus-Turbo GEMMs off)")
        return None
    if split and not defers(module):
        return (f"{_describe(name, module)} is a Transformer Engine {gemm} built without delay_wgrad_compute, so its "
                "weight gradient would be computed inside B and its W would be empty; set "
                "config.delay_wgrad_compute=True (TE >= 2.3; see enable_delay_wgrad_compute) before building the model")
    if defers(module) and not getattr(module, "wgrad_accumulation_and_reduce_hooks", None):
        return (f"{_describe(name, module)} defers its weight gradient (delay_wgrad_compute) but no hook consumes what "
                "backward_dw assigns to .grad (TE assigns, it does not accumulate, so microbatches would overwrite "
                "each other); wrap the model in Megatron DDP with ddp_config.delay_wgrad_compute=True")
    return None


def _deferring(model: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(model, torch.nn.Module):  # e.g. a test's placeholder chunk
        return ()
    if model not in _DEFERRING:  # found once per chunk object: a built model's modules do not change
        _DEFERRING[model] = tuple((name, module) for name, module in model.named_modules()
                                  if te_weight_gemm(module) is not None and defers(module))
    return _DEFERRING[model]


def deferring_te_modules(models: Sequence[Any]) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """Per chunk, ``(name, module)`` of the TE modules whose weight GEMMs wait for ``backward_dw``."""
    return tuple(_deferring(model) for model in models)


_DEFERRING: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_ACCEPTED: "weakref.WeakKeyDictionary[torch.nn.Module, set[bool]]" = weakref.WeakKeyDictionary()
"""Chunk -> the ``split`` values its modules were already accepted for."""


def plan_te_deferral(models: Sequence[torch.nn.Module], config: Any, split: bool) -> tuple[tuple[Any, ...], ...]:
    """:func:`deferring_te_modules`, after refusing -- :class:`ConfigError`, one line naming the first
    module -- what cannot run with a split (``split=True``: the table has ``B``/``W`` nodes) or a fused
    backward. TE attention, norms and other modules without a weight GEMM need nothing and are accepted.
    """
    kind = "split-backward (B/W) schedules" if split else "primuspipe's Megatron backend"
    for model in models:
        if not isinstance(model, torch.nn.Module) or split in _ACCEPTED.get(model, ()):
            continue
        for name, module in model.named_modules():
            why = _refusal(name, module, split)
            if why is not None:
                raise ConfigError(f"{kind}: {why}")
        _ACCEPTED.setdefault(model, set()).add(split)
    plan = deferring_te_modules(models)
    if split and any(plan) and getattr(config, "use_transformer_engine_op_fuser", False):
        raise ConfigError(
            f"{kind}: use_transformer_engine_op_fuser=True runs TE layers such as {_describe(*_first(plan))} "
            "through Transformer Engine's fused operations (TEGroupedMLP's and TEFusedMLP's fused path), which "
            "compute the weight gradient in the backward and never fill the modules' stores; unset it")
    mlp_fp8_bias = [(n, m) for chunk in plan for n, m in chunk if te_weight_gemm(m) == "LayerNormMLP"
                    and getattr(m, "use_bias", False)]
    if split and mlp_fp8_bias and getattr(config, "fp8", None):
        raise ConfigError(
            f"{kind}: {_describe(*mlp_fp8_bias[0])} has biases and config.fp8 is set: TE's LayerNormMLP computes fc2's "
            "bias gradient in backward_dw under some FP8 recipes and in the backward under others, which a W node "
            "cannot tell apart; set add_bias_linear=False or use a schedule with a fused backward (1f1b)")
    return plan


def _first(plan: Sequence[Sequence[tuple[str, Any]]]) -> tuple[str, Any]:
    """The first ``(name, module)`` of a plan that has one."""
    return next(entry for chunk in plan for entry in chunk)


def enable_delay_wgrad_compute(config: Any, ddp_config: Any = None) -> None:
    """Turn TE's weight-gradient deferral on for a model primuspipe will schedule: set it on the
    ``TransformerConfig`` (after its checks, which tie the flag to Megatron's combined 1F1B, the only
    Megatron schedule that calls ``backward_dw``) before building the model, and on the DDP config so DDP
    hooks the gradient through ``backward_dw``."""
    config.delay_wgrad_compute = True
    if ddp_config is not None:
        ddp_config.delay_wgrad_compute = True


def _queued(module: torch.nn.Module) -> int:
    return module.wgrad_store.context.qsize()


def _hold_bias_grads(module: torch.nn.Module) -> None:
    """Where a module's bias gradient is computed in the backward (``return_bias``, Megatron's
    ``skip_bias_add``, or FP8), the deferred GEMM has none, yet TE's ``backward_dw`` assigns it whenever
    ``bias.grad is None`` (``None.to``: an error) -- which happens as soon as two ``B`` nodes precede a ``W``
    (the first ``W``'s DDP hook consumed both microbatches' bias gradients). A zero ``.grad`` makes it skip
    the assignment; the hook then adds that zero."""
    if not (getattr(module, "return_bias", False) or getattr(module, "fp8", False)):
        return
    for name, param in module.named_parameters(recurse=False):
        if "bias" in name and param.grad is None and param.requires_grad:
            param.grad = torch.zeros_like(param)


class _Forwarding:
    """The ``(chunk, microbatch)`` whose forward (or recompute) runs now, for the forward hook."""

    deferral: "TEDeferral | None" = None
    key: tuple[int, int] | None = None


def _count_forward(module: torch.nn.Module, args: Any) -> None:
    deferral = _Forwarding.deferral
    if deferral is not None and torch.is_grad_enabled():
        deferral._forwards[_Forwarding.key][module] += 1


_HOOKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


class TEDeferral:
    """One step's accounting of TE's deferred weight GEMMs (see the module docstring)."""

    def __init__(self, plan: Sequence[Sequence[tuple[str, torch.nn.Module]]]):
        self._plan = tuple(tuple(chunk) for chunk in plan)
        self._names = {module: name for chunk in self._plan for name, module in chunk}
        self._pending: dict[tuple[int, int], list[tuple[torch.nn.Module, int]]] = {}
        self._labels: dict[torch.nn.Module, deque[int]] = {m: deque() for m in self._names}
        self._forwards: dict[tuple[int, int], Counter] = {}
        for module in self._names:
            if module not in _HOOKED:
                module.register_forward_pre_hook(_count_forward)
                _HOOKED.add(module)
        for module in self._names:
            if _queued(module):
                raise WeightGradError(f"{self._describe(module)} starts the step with {_queued(module)} deferred weight "
                                  "GEMM(s) in its Transformer Engine store (an earlier step or code outside primuspipe "
                                  "left them); they would be applied to the wrong microbatches")

    def _describe(self, module: torch.nn.Module) -> str:
        return _describe(self._names[module], module)

    @contextlib.contextmanager
    def _active(self, key: tuple[int, int]) -> Iterator[None]:
        self._forwards.setdefault(key, Counter())
        previous = (_Forwarding.deferral, _Forwarding.key)
        _Forwarding.deferral, _Forwarding.key = self, key
        try:
            yield
        finally:
            _Forwarding.deferral, _Forwarding.key = previous

    def forwarding(self, chunk: int, microbatch: int):
        """Around an ``F``: counts which deferring modules ran for this microbatch."""
        return self._active((chunk, microbatch))

    @contextlib.contextmanager
    def collecting(self, chunk: int, microbatch: int) -> Iterator[None]:
        """Around a ``B`` (or a ``BW``'s backward): records what each module of the chunk deferred."""
        modules = [m for _, m in self._plan[chunk]]
        before = [_queued(m) for m in modules]
        with self._active((chunk, microbatch)):
            yield
        ran = self._forwards.pop((chunk, microbatch))
        entries = []
        for module, size in zip(modules, before):
            added = _queued(module) - size
            if added == 0 and ran[module] and any(p.requires_grad for p in module.parameters()):
                raise WeightGradError(
                    f"{self._describe(module)} ran forward for microbatch {microbatch} of chunk {chunk} but its backward "
                    "put no weight GEMM in its Transformer Engine store: the weight gradient was computed inside B (or "
                    "sent elsewhere, e.g. by a patched WeightGradStore), so W would be empty")
            if added:
                entries.append((module, added))
                self._labels[module].extend([microbatch] * added)
        self._pending[(chunk, microbatch)] = entries

    def flush(self, chunk: int, microbatch: int) -> int:
        """A ``W``: run this microbatch's deferred GEMMs (``backward_dw``); returns how many entries."""
        entries = self._pending.pop((chunk, microbatch), [])
        for module, count in entries:
            labels = self._labels[module]
            if labels[0] != microbatch:
                raise WeightGradError(
                    f"W{microbatch}.{chunk}: the oldest deferred weight GEMM of {self._describe(module)} is microbatch "
                    f"{labels[0]}'s; Transformer Engine's store is first-in-first-out, so each chunk's W nodes must run "
                    "in the order of its B nodes (primuspipe validate --fifo-weight-grads)")
            target = _queued(module) - count
            while _queued(module) > target:
                size = _queued(module)
                _hold_bias_grads(module)
                module.backward_dw()
                if _queued(module) >= size:
                    raise WeightGradError(f"{self._describe(module)}.backward_dw() left its store unchanged ({size} "
                                      "deferred GEMMs): is config.delay_wgrad_compute still set?")
            if _queued(module) != target:
                raise WeightGradError(f"{self._describe(module)}.backward_dw() ran more deferred GEMMs than microbatch "
                                  f"{microbatch} put there")
            for _ in range(count):
                labels.popleft()
        return sum(count for _, count in entries)

    def check_empty(self) -> None:
        """Raise unless every deferring module's store is empty (call at step end)."""
        left = [f"{self._names[m]}: {_queued(m)}" for m in self._names if _queued(m)]
        if left:
            more = f" and {len(left) - 3} more modules" if len(left) > 3 else ""
            raise WeightGradError("the step ended with deferred weight GEMMs still in Transformer Engine's stores ("
                              + "; ".join(left[:3]) + more + "); every B needs its W in the same step")
