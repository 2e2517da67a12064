"""Weight-gradient deferral for megatron-core's local linear layers: what makes a ``W`` node real.

Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` (behind every local-spec
``ColumnParallelLinear`` / ``RowParallelLinear``, the output layer and the ``SequentialMLP`` experts)
computes the input gradient and the weight gradient in one autograd call. Running the backward twice
(once for inputs, once for weights) would recompute the dgrad, so a ``W`` node would cost a whole
backward. Instead, while a ``B`` node runs (:meth:`WeightGradStore.collecting`), the function's
backward is swapped for :func:`_dgrad_only_backward`, which

* computes the input gradient exactly as Megatron does (incl. the tensor-parallel all-reduce or
  sequence-parallel reduce-scatter) and the bias gradient (a cheap reduction, left in ``B``);
* stashes what the weight gradient needs -- the layer's saved input, ``grad_output``, the weight, and
  the ``main_grad`` / ``gradient_accumulation_fusion`` handles the forward recorded -- under the
  ``(chunk, microbatch)`` of the running ``B``.

The ``W`` node (:meth:`WeightGradStore.flush`) pops that microbatch's entries, runs the wgrad GEMMs
(all-gathering the input first under sequence parallelism, as Megatron's backward does) and hands the
results to autograd's own accumulator of each weight (``torch.autograd.backward`` on the leaf), so
``.grad`` accumulation and every hook on it -- Megatron DDP's ``main_grad`` accumulation, its
``grad_added_to_main_grad`` protocol under ``gradient_accumulation_fusion`` -- behave exactly as if
Megatron's backward had returned the gradient.

Gradients computed in ``B`` (not deferred): layer norms, embeddings (word and position), biases, the
MoE router, and any parameter not behind this linear function. Layers the swap leaves alone (their
wgrad stays in ``B``): Megatron's own ``defer_embedding_wgrad_compute`` buffer (``grad_output_buffer``),
GTP weight rematerialisation. Transformer Engine layers defer through TE's own store
(``delay_wgrad_compute``), which the same ``B``/``W`` calls drive: :mod:`.te_deferral`.

The swap is scoped: the class attribute is replaced only inside :meth:`WeightGradStore.collecting`
and restored on exit, so Megatron's own schedules, ``F``/``BW`` nodes and other code never see it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from primuspipe.backends.megatron.te_deferral import TEDeferral, deferring_te_modules, plan_te_deferral
from primuspipe.errors import ConfigError, WeightGradError


@dataclass(frozen=True)
class _Deferred:
    """One linear call's weight-gradient work."""

    weight: torch.nn.Parameter
    input: torch.Tensor
    """The layer's input as its forward saved it (this rank's shard under sequence parallelism)."""
    grad_output: torch.Tensor
    main_grad: Any
    """``weight.main_grad`` as the forward saw it (``None`` without gradient accumulation fusion)."""
    gradient_accumulation_fusion: bool
    sequence_parallel: bool
    tp_group: Any


Key = tuple[int, int]
"""``(chunk, microbatch)``."""


class _Active:
    """The store and key collecting right now (one ``B`` node at a time per process)."""

    store: "WeightGradStore | None" = None
    key: Key | None = None


def _layers_module():
    from megatron.core.tensor_parallel import layers

    return layers


def _dgrad_only_backward(ctx, grad_output):
    """Megatron's linear backward without the weight GEMM; mirrors
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` line by line for the dgrad part."""
    layers = _layers_module()
    store = _Active.store
    if store is None or ctx.grad_output_buffer is not None or ctx.gtp_remat_size > 1:
        return _ORIGINAL[0](ctx, grad_output)
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    input, weight = ctx.saved_tensors
    tp_group = ctx.tp_group
    grad_input = grad_output.matmul(weight)
    handle = None
    if ctx.allreduce_dgrad:
        handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
    if ctx.sequence_parallel:
        assert not ctx.allreduce_dgrad
        sub_grad_input = torch.empty(input.size(), dtype=input.dtype, device=input.device, requires_grad=False)
        handle = layers.dist_reduce_scatter_func(sub_grad_input, grad_input, group=tp_group, async_op=True)
        grad_input = sub_grad_input
    grad_bias = None
    if ctx.use_bias:
        grad_output_2d, _ = prepare_input_tensors_for_wgrad_compute(grad_output, input)
        grad_bias = grad_output_2d.sum(dim=0)
    store._stash(_Deferred(weight, input, grad_output, ctx.main_grad, ctx.gradient_accumulation_fusion,
                           ctx.sequence_parallel, tp_group))
    if handle is not None:
        handle.wait()
    return grad_input, None, grad_bias, None, None, None, None, None, None, None


def _storage_key(tensor: torch.Tensor) -> tuple:
    """What identifies a parameter's memory, whichever tensor object shows it."""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype


_ORIGINAL: list = []
"""Megatron's backward and our replacement, made the first time a store collects."""


def _compute_wgrad(item: _Deferred) -> torch.Tensor | None:
    """What Megatron's backward would have returned as ``grad_weight`` (after any in-place
    ``main_grad`` accumulation under gradient accumulation fusion)."""
    layers = _layers_module()
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    weight, total_input = item.weight, item.input
    if item.sequence_parallel:
        dim_size = list(item.input.size())
        dim_size[0] = dim_size[0] * item.tp_group.size()
        total_input = layers.get_global_memory_buffer().get_tensor(dim_size, item.input.dtype, "mpu")
        layers.dist_all_gather_func(total_input, item.input, group=item.tp_group)
    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(item.grad_output, total_input)
    if not item.gradient_accumulation_fusion:
        return grad_output.t().matmul(total_input)
    weight.main_grad = item.main_grad
    if hasattr(weight, "__fsdp_param__"):
        raise ConfigError("Megatron-FSDP parameters with gradient_accumulation_fusion are not supported by "
                          "primuspipe's split-backward (W) nodes; turn gradient_accumulation_fusion off")
    if weight.main_grad.dtype == torch.float32:
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
    elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # As Megatron: a dummy gradient goes through autograd so DDP's hook runs on this thread; the flag
    # tells the hook the real gradient is already in main_grad.
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    dummy = make(weight.main_grad.shape, dtype=item.input.dtype, device=item.input.device, requires_grad=False)
    weight.grad_added_to_main_grad = True
    return dummy


class WeightGradStore:
    """Deferred weight-gradient work of one step, keyed by ``(chunk, microbatch)``.

    >>> store = WeightGradStore()
    >>> store.pending()
    ()
    """

    def __init__(self, models: Sequence[torch.nn.Module] = ()) -> None:
        self._work: dict[Key, list[_Deferred]] = {}
        self._models = tuple(models)
        plan = deferring_te_modules(self._models)
        self._te = TEDeferral(plan) if any(plan) else None
        """Transformer Engine modules deferring through their own stores, or ``None``."""
        self._parameters: dict[tuple, torch.nn.Parameter] | None = None
        """What identifies each parameter's memory -> the parameter; built at the first weight that is
        not a parameter object (see :meth:`_stash`), never in a step without saved-tensor hooks."""
        self.timed: tuple[dict[int, str], Any] | None = None
        """While a step is recorded: (id of a weight -> the part of the model it is in, the recorder) --
        :meth:`flush` reports its GEMMs as time in that part (:mod:`.layer_timing`)."""

    @contextlib.contextmanager
    def collecting(self, chunk: int, microbatch: int) -> Iterator[None]:
        """Run the enclosed backward (a ``B`` node) with weight GEMMs of Megatron's linear layers deferred."""
        key = (chunk, microbatch)
        if key in self._work:
            raise WeightGradError(f"B{microbatch}.{chunk} ran twice in one step (its weight gradients are still "
                                  "pending); the table must have one B per (chunk, microbatch)")
        assert _Active.store is None, "nested B nodes"
        layers = _layers_module()
        cls = layers.LinearWithGradAccumulationAndAsyncCommunication
        if not _ORIGINAL:
            _ORIGINAL.extend((cls.backward, staticmethod(layers.custom_bwd(_dgrad_only_backward))))
        self._work[key] = []
        _Active.store, _Active.key = self, key
        cls.backward = _ORIGINAL[1]
        try:
            with self._te.collecting(chunk, microbatch) if self._te else contextlib.nullcontext():
                yield
        finally:
            cls.backward = _ORIGINAL[0]
            _Active.store = _Active.key = None

    def _stash(self, item: _Deferred) -> None:
        # Under saved-tensor hooks (activation offload) autograd unpacks a saved parameter as a new tensor
        # sharing its storage, tied to the parameter only by a weak reference to its gradient accumulator;
        # once no live graph holds that accumulator, a gradient sent to the copy lands on the copy and is
        # lost. So the W node sends it to the module's own parameter.
        if not isinstance(item.weight, torch.nn.Parameter):
            if self._parameters is None:
                self._parameters = {_storage_key(p): p for m in self._models for p in m.parameters()}
            item = replace(item, weight=self._parameters.get(_storage_key(item.weight), item.weight))
        self._work[_Active.key].append(item)

    def flush(self, chunk: int, microbatch: int) -> int:
        """Apply ``(chunk, microbatch)``'s weight gradients (a ``W`` node); returns the number of GEMMs."""
        try:
            work = self._work.pop((chunk, microbatch))
        except KeyError:
            have = ", ".join(f"B{mb}.{c}" for c, mb in sorted(self._work)) or "none"
            raise WeightGradError(
                f"W{microbatch}.{chunk} has no deferred weight gradients: B{microbatch}.{chunk} did not run before "
                f"it on this rank in this step, or its W already ran (pending: {have})") from None
        weights, grads = [], []
        part_of, recorder = self.timed or ({}, None)
        # each weight's span runs from the previous one's end (the first from here) and frees what B kept
        # for it (its input and output gradient): the loop's own work and the freeing per weight are the
        # layers' cost, paid per layer whatever the chunk, not a fixed cost every chunk pays
        # (docs/simulator.md, "Fixed parts")
        mark = recorder.clock() if recorder is not None else None
        for i in range(len(work)):
            item, work[i] = work[i], None
            weight = item.weight
            with torch.no_grad():  # as inside autograd's backward, where Megatron computes them
                grad = _compute_wgrad(item)
            del item
            if recorder is not None:
                now = recorder.clock()
                if (part := part_of.get(id(weight))) is not None:
                    recorder.inside(part, mark, now)
                mark = now
            if grad is not None:
                weights.append(weight)
                grads.append(grad)
        if weights:
            # Autograd's accumulator of each weight adds to .grad and runs its hooks (e.g. Megatron DDP's
            # main_grad accumulation), as it does when the fused backward returns the gradient.
            torch.autograd.backward(weights, grads)
            if recorder is not None:
                _report_shares(recorder, part_of, weights, mark)
        return len(work) + (self._te.flush(chunk, microbatch) if self._te else 0)

    def forwarding(self, chunk: int, microbatch: int):
        """Around an ``F`` node: lets the TE accounting see which modules ran for this microbatch."""
        return self._te.forwarding(chunk, microbatch) if self._te else contextlib.nullcontext()

    @contextlib.contextmanager
    def fused(self, chunk: int, microbatch: int) -> Iterator[None]:
        """Around a fused ``BW`` node's backward: TE modules that defer run ``backward_dw`` right after it
        (Megatron DDP hooks their gradients through it); local layers are left alone."""
        if self._te is None:
            yield
            return
        with self._te.collecting(chunk, microbatch):
            yield
        self._te.flush(chunk, microbatch)

    def pending(self) -> tuple[Key, ...]:
        """``(chunk, microbatch)`` keys whose ``W`` has not run."""
        return tuple(sorted(self._work))

    def check_empty(self) -> None:
        """Raise if a ``B`` was not followed by its ``W`` (call at step end)."""
        if self._te is not None:
            self._te.check_empty()
        if self._work:
            missing = ", ".join(f"W{mb}.{c}" for c, mb in sorted(self._work))
            raise WeightGradError(f"the step ended with weight gradients never applied: {missing} did not run "
                                  "(every B needs its W in the same step); gradients of those microbatches are "
                                  "incomplete")


def _report_shares(recorder: Any, part_of: dict[int, str], weights: list, start: Any) -> None:
    """One accumulation call served every weight: from ``start`` (the last GEMM's end) until the shares
    are worked out (a pass over the weights, work per layer too), each part of the model gets its
    weights' share of the elements (the accumulation is an add per element)."""
    total = sum(w.numel() for w in weights)
    shares = {part: mine / total for part in set(part_of.values())
              if (mine := sum(w.numel() for w in weights if part_of.get(id(w)) == part))}
    end = recorder.clock()
    for part, share in shares.items():
        recorder.inside(part, start, end, share)


def check_deferrable(models: Sequence[torch.nn.Module], config: Any = None, split: bool = True) -> bool:
    """Refuse models whose weight GEMMs neither this store nor Transformer Engine's can defer for the table
    (``split``: it has ``B``/``W`` nodes) -- one line naming the module, see
    :func:`~primuspipe.backends.megatron.te_deferral.plan_te_deferral`. Returns whether any module defers
    through TE (then the table must pass the FIFO weight-gradient rule)."""
    return any(plan_te_deferral(models, config, split))
