"""The Megatron binder: ``F`` -> megatron-core ``forward_step``, ``BW`` -> ``backward_step``; the
split backward: ``B`` -> ``backward_step`` with weight GEMMs deferred to a
:class:`~primuspipe.backends.megatron.wgrad_store.WeightGradStore`, ``W`` -> that store's flush
(Transformer Engine layers: TE's own store and ``backward_dw``, which a ``BW`` also calls right after its
backward; :mod:`.te_deferral`). An overlapped ``FB`` node has no handler of its own, so the runner runs its ``F`` then its ``B`` (on one
device stream the overlap is the schedule's placement of the pair, not concurrency).

One binder serves one call of the forward-backward function (one step); its per-step state is explicit
and keyed by ``(chunk, microbatch)``. What Megatron's own schedules do around those two calls is
reproduced here, per node rather than per warm-up/steady/cool-down phase, so it holds for any table:

* ``is_first_microbatch`` is microbatch 0 of a chunk (modulated by ``first_val_step`` when
  evaluating), ``current_microbatch`` is the node's microbatch, ``vp_stage`` the chunk (``None``
  without interleaving), ``is_last_stage`` the model's last stage;
* gradient sync (:class:`GradSync`): Megatron's ``no_sync`` is entered for the whole step and left
  only around each chunk's last ``BW`` or ``W`` on this rank (without ``grad_sync_func``) or right after
  it, calling ``grad_sync_func[chunk]`` (with one): with a split backward a weight's gradient is
  complete only after the chunk's last ``W``, so a ``B`` never opens the sync; chunks not yet
  synchronized are synchronized at the end. Under ``overlap_grad_reduce`` a split-backward step
  without ``grad_sync_func`` starts each chunk's bucket reduces itself after that ``W`` (DDP's hooks
  cannot), and ``B`` nodes run DDP's hooks in their non-overlapped mode (:func:`_hooks_without_overlap`);
* parameter sync with interleaving: ``param_sync_func`` for chunks 0 and 1 at the start, for chunk
  c >= 2 before its first forward;
* ``deallocate_pipeline_outputs``: an activation is pseudo-freed as soon as its send is posted (the
  transport keeps its data alive until the transfer is done) or it is handed to the next stage on the
  same rank (the V's turn; Megatron's ``backward_step`` then insists on a pseudo-freed output);
* loss dicts are kept per microbatch and returned in microbatch order, as Megatron's schedules return
  them for the built-in algorithms.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from primuspipe.backends.megatron.layer_timing import timing_layers
from primuspipe.backends.megatron.wgrad_store import WeightGradStore
from primuspipe.errors import ConfigError
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.runtime.activation_offload import ActivationOffload
from primuspipe.runtime.protocols import ComputeCall, named_handlers


@dataclass(frozen=True)
class StepArgs:
    """What one forward-backward call was given, normalised (lists even without interleaving)."""

    forward_step_func: Callable
    data_iterators: Sequence[Any]
    models: Sequence[torch.nn.Module]
    num_microbatches: int
    config: Any
    cp_group_size: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: bool | None
    interleaved: bool


class GradSync:
    """Megatron's ``no_sync`` / ``grad_sync_func`` / ``param_sync_func`` protocol for one step."""

    def __init__(self, args: StepArgs, last_backward: Mapping[int, int], grad_sync_func, param_sync_func,
                 split_backward: bool = False):
        no_sync = args.config.no_sync_func
        if isinstance(no_sync, list):
            funcs = list(no_sync)

            def no_sync():  # noqa: F811 - Megatron's multi-chunk no_sync
                stack = contextlib.ExitStack()
                for f in funcs:
                    stack.enter_context(f())
                return stack

        self._no_sync = no_sync or contextlib.nullcontext
        self._context = None
        self.models = args.models
        self.last_backward = last_backward
        """chunk -> microbatch of that chunk's last backward on this rank."""
        self.grad_sync = self._per_chunk(grad_sync_func)
        if self.grad_sync is None and split_backward and not args.forward_only:
            self.grad_sync = self._overlapped_starts()
        self.param_sync = self._per_chunk(param_sync_func) if args.interleaved else None
        self.synchronized: set[int] = set()
        self.param_synced: set[int] = set()

    def _per_chunk(self, func):
        if func is None or isinstance(func, list):
            return func
        return [func for _ in self.models]

    def _overlapped_starts(self) -> list | None:
        """Without ``grad_sync_func``, Megatron DDP under ``overlap_grad_reduce`` starts a bucket's
        reduction from its backward hooks once every parameter of the bucket reported in the last
        microbatch. With a split backward the last microbatch's parameters report across the chunk's
        last ``B`` (norms, biases) and last ``W`` (weights), and DDP records the first step's reports as
        the set to wait for, so it would wait for a partial set (or assert). So a split-backward step
        keeps ``no_sync`` on throughout and starts each such chunk's reduction (``start_grad_sync``,
        what ``megatron.training`` passes as ``grad_sync_func``) after the chunk's last ``W``: the
        point where every gradient of every bucket of the chunk is final."""
        starts = [m.start_grad_sync if getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce", False) else None
                  for m in self.models]
        return starts if any(starts) else None

    def disable(self) -> None:
        if self._context is None:
            self._context = self._no_sync()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def begin(self) -> None:
        self.disable()
        if self.param_sync is not None:
            for chunk in range(min(2, len(self.models))):
                self._sync_params(chunk)

    def _sync_params(self, chunk: int) -> None:
        if chunk not in self.param_synced:
            self.param_synced.add(chunk)
            self.param_sync[chunk](self.models[chunk].parameters())

    def before_forward(self, chunk: int) -> None:
        if self.param_sync is not None:
            self._sync_params(chunk)

    def _sync_func(self, chunk: int):
        return None if self.grad_sync is None else self.grad_sync[chunk]

    @contextlib.contextmanager
    def around_backward(self, chunk: int, microbatch: int):
        last = self.last_backward.get(chunk) == microbatch
        sync = self._sync_func(chunk)
        if last and sync is None:
            self.enable()
            self.synchronized.add(chunk)
        yield
        if last and sync is not None:
            self.enable()
            sync(self.models[chunk].parameters())
            self.synchronized.add(chunk)
        self.disable()

    def end(self) -> None:
        self.enable()
        for chunk in range(len(self.models)):
            if chunk not in self.synchronized and (sync := self._sync_func(chunk)) is not None:
                sync(self.models[chunk].parameters())
                self.synchronized.add(chunk)


@contextlib.contextmanager
def _hooks_without_overlap(models: Sequence[torch.nn.Module]):
    """Run a ``B`` node with Megatron DDP's backward hooks in their non-overlapped mode.

    A weight whose GEMM ``B`` defers still reaches its gradient accumulator, with no gradient, and under
    ``overlap_grad_reduce`` DDP's hook asserts a gradient is there and registers the parameter as ready.
    Inside a ``B`` gradient sync is always off (``no_sync``: registering is a no-op, :class:`GradSync`
    starts the reduction after the chunk's last ``W``), so what remains of the hook -- add ``.grad`` to
    ``main_grad`` where there is one -- is all it has to do. Restored on leaving the node."""
    configs = {id(c): c for m in models if (c := getattr(m, "ddp_config", None)) is not None and c.overlap_grad_reduce}
    for config in configs.values():
        config.overlap_grad_reduce = False
    try:
        yield
    finally:
        for config in configs.values():
            config.overlap_grad_reduce = True


class MegatronBinder:
    """Runs ``F``, ``BW``, ``B``, ``W`` and ``FB`` nodes with megatron-core's ``forward_step`` and
    ``backward_step``; ``wgrad`` holds the weight gradients deferred from ``B`` to ``W``."""

    def __init__(self, args: StepArgs, *, num_stages: int, transfer_shape: Sequence[int], device: torch.device,
                 sync: GradSync, offload: ActivationOffload | None = None):
        from megatron.core.pipeline_parallel import schedules

        self._schedules = schedules
        self.args = args
        self.last_stage = num_stages - 1
        self.transfer_shape = tuple(transfer_shape)
        self.device = device
        self.sync = sync
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        self.forward_data: dict[int, list] = {}
        """microbatch -> what forward_step stored for it (loss dicts or non-loss data), last stage only."""
        self._saved: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.wgrad = WeightGradStore(args.models)
        self.offload = offload
        self.handlers = MappingProxyType(named_handlers(self) | (offload.handlers() if offload is not None else {}))

    def forward(self, call: ComputeCall) -> Any:
        a = self.args
        self.sync.before_forward(call.chunk)
        store: list = []
        is_first = call.microbatch == 0
        if a.first_val_step is not None and a.forward_only:
            is_first = a.first_val_step and is_first
        saving = self.offload.forward(call.chunk, call.microbatch) if self.offload else contextlib.nullcontext()
        with saving, self.wgrad.forwarding(call.chunk, call.microbatch):
            output, num_tokens = self._schedules.forward_step(
                functools.partial(_checked_forward_step, a.forward_step_func, call, a.num_microbatches),
                a.data_iterators[call.chunk],
                a.models[call.chunk],
                a.num_microbatches,
                call.received,
                store,
                a.config,
                cp_group_size=a.cp_group_size,
                collect_non_loss_data=a.collect_non_loss_data,
                is_first_microbatch=is_first,
                current_microbatch=call.microbatch,
                vp_stage=call.chunk if a.interleaved else None,
                is_last_stage=call.stage == self.last_stage,
            )
        self._check_output(call, output)
        self.total_num_tokens += num_tokens
        if store:
            self.forward_data.setdefault(call.microbatch, []).extend(store)
        if not a.forward_only:
            self._saved[(call.chunk, call.microbatch)] = (call.received, output)
        return output

    def _check_output(self, call: ComputeCall, output: Any) -> None:
        """What a forward hands on must be what the next stage receives: a tensor of the transfer shape
        (``seq_length``, ``micro_batch_size``, hidden) in ``pipeline_dtype`` -- another size lands in a receive
        buffer it does not fill (on two gloo ranks: a shape error deep in the next stage's model, garbage where
        the shapes happen to fit) or aborts the transfer, another 16-bit dtype is read as garbage -- and on the
        last stage of a training step one loss value to run the backward from (else torch's "grad can be
        implicitly created only for scalar outputs")."""
        where = f"microbatch {call.microbatch} (stage {call.stage}, chunk {call.chunk})"
        if call.stage != self.last_stage:
            dtype = self.args.config.pipeline_dtype
            fits = isinstance(output, torch.Tensor) and tuple(output.shape) == self.transfer_shape \
                and output.dtype == dtype
            if not fits:
                got = (f"{tuple(output.shape)} {output.dtype}" if isinstance(output, torch.Tensor)
                       else type(output).__name__)
                raise ConfigError(
                    f"forward_step_func's output for {where} is {got}, but the next stage receives "
                    f"{self.transfer_shape} {dtype} (seq_length, micro_batch_size, hidden_size as passed to the "
                    "forward-backward function, and Megatron's pipeline_dtype); pass the seq_length and "
                    "micro_batch_size of the batches, or return the stage's hidden states in pipeline_dtype")
        elif not self.args.forward_only and not (isinstance(output, torch.Tensor) and output.numel() == 1):
            got = (f"a tensor of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor)
                   else type(output).__name__)
            raise ConfigError(
                f"the last stage's loss for {where} is {got}, but a training step runs its backward from one loss "
                "value; return a loss function from forward_step_func whose first result is the scalar loss (or "
                "pass forward_only=True, which collect_non_loss_data needs)")

    def _backward_step(self, call: ComputeCall) -> Any:
        input_tensor, output = self._saved.pop((call.chunk, call.microbatch))
        return self._schedules.backward_step(input_tensor, output, call.received, self.args.config)

    def backward(self, call: ComputeCall) -> Any:
        with self.sync.around_backward(call.chunk, call.microbatch), self.wgrad.fused(call.chunk, call.microbatch):
            return self._backward_step(call)

    def backward_input(self, call: ComputeCall) -> Any:
        """``B``: the input gradient now; the weight GEMMs wait in :attr:`wgrad` for this microbatch's ``W``."""
        with self.wgrad.collecting(call.chunk, call.microbatch), _hooks_without_overlap(self.args.models):
            return self._backward_step(call)

    def backward_weight(self, call: ComputeCall) -> None:
        """``W``: the weight gradients ``B`` deferred; the chunk's last ``W`` opens gradient sync."""
        with self.sync.around_backward(call.chunk, call.microbatch):
            self.wgrad.flush(call.chunk, call.microbatch)

    def timing_layers(self, recorder: Any):
        """While a step is recorded: each node's time inside the chunks' decoders, to ``recorder``
        (:mod:`.layer_timing`)."""
        return timing_layers(self.args.models, recorder, self.wgrad)

    def recv_buffer(self, node: ScheduleNode) -> torch.Tensor:
        return torch.empty(self.transfer_shape, dtype=self.args.config.pipeline_dtype, device=self.device,
                           requires_grad=node.kind is NodeKind.RECV_F)

    def local_handoff(self, tensor: torch.Tensor, carries: NodeKind) -> torch.Tensor:
        handed = tensor.detach().requires_grad_(carries is NodeKind.F)
        if carries is NodeKind.F:  # as if sent: the next stage holds the data through ``handed``
            self._schedules.deallocate_output_tensor(tensor, self.args.config.deallocate_pipeline_outputs)
        return handed

    def sent(self, node: ScheduleNode, tensor: torch.Tensor) -> None:
        if node.kind is NodeKind.SEND_F:
            self._schedules.deallocate_output_tensor(tensor, self.args.config.deallocate_pipeline_outputs)

    def forward_data_store(self) -> list:
        return [item for mb in sorted(self.forward_data) for item in self.forward_data[mb]]


def _checked_forward_step(forward_step_func: Callable, call: ComputeCall, num_microbatches: int, data_iterator: Any,
                          model: Any) -> tuple[Any, Any]:
    """``forward_step_func(data_iterator, model)`` held to Megatron's contract, each break refused in one line
    naming the microbatch and stage (Megatron's ``forward_step`` meets them as an unpacking error, a bare
    assert, or a StopIteration that a generator around the training loop would swallow): it returns
    ``(output, loss_func)`` with ``loss_func`` callable or None; its data iterator does not run out before
    ``num_microbatches``; ``loss_func`` returns ``(loss, reported)`` or ``(loss, num_tokens, reported)``
    with tensors for the loss and an integer token count."""
    where = f"microbatch {call.microbatch} of chunk {call.chunk} (stage {call.stage})"
    try:
        result = forward_step_func(data_iterator, model)
    except StopIteration:
        raise ConfigError(
            f"forward_step_func's data iterator ran out at {where}: the step runs num_microbatches={num_microbatches} "
            "forwards per chunk, each drawing one batch; give every chunk's iterator at least num_microbatches "
            "batches (or pass the num_microbatches it holds)") from None
    if not isinstance(result, (tuple, list)) or len(result) != 2 or not (result[1] is None or callable(result[1])):
        got = (f"a {type(result).__name__} of {len(result)}" if isinstance(result, (tuple, list))
               else type(result).__name__)
        raise ConfigError(f"forward_step_func returned {got} for {where}; Megatron's contract is (output_tensor, "
                          "loss_func) with loss_func callable (or None on stages without a loss)")
    output, loss_func = result
    return output, None if loss_func is None else functools.partial(_checked_loss, loss_func, where)


def _checked_loss(loss_func: Callable, where: str, *args: Any, **kwargs: Any) -> Any:
    """``loss_func``'s result, refused in one line when it is not ``(loss, reported)`` or ``(loss, num_tokens,
    reported)`` (its non-loss data, with ``non_loss_data=True``, is the caller's to shape)."""
    outputs = loss_func(*args, **kwargs)
    if kwargs.get("non_loss_data"):
        return outputs
    fits = isinstance(outputs, (tuple, list)) and len(outputs) in (2, 3) and isinstance(outputs[0], torch.Tensor)
    if fits and len(outputs) == 3:
        tokens = outputs[1]
        fits = isinstance(tokens, torch.Tensor) and tokens.numel() == 1 and not tokens.is_floating_point() \
            and not tokens.is_complex() and tokens.dtype is not torch.bool
    if not fits:
        got = (f"({', '.join(_kind(o) for o in outputs)})" if isinstance(outputs, (tuple, list))
               else _kind(outputs))
        raise ConfigError(
            f"the loss function of {where} returned {got}; Megatron's contract is (loss, reported_dict) or (loss, "
            "num_tokens, reported_dict) with the loss a tensor and num_tokens a one-element integer tensor")
    return outputs


def _kind(value: Any) -> str:
    """A result's type as the refusals print it (a tensor with its shape and dtype)."""
    return f"tensor{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
