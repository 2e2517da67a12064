"""One training step of a tiny Megatron GPT through a given forward-backward function, reduced to
comparable numbers: what tests, the bench and ``examples/train_gpt.py --compare-native`` share.

Call inside an initialised process (``parallel_state`` set up, e.g. by
:func:`~primuspipe.testing.megatron.distributed_cpu.run_on_gloo` or ``torchrun``). Weights come from
:func:`~primuspipe.testing.megatron.tiny_models.build_model_chunks` (layout-independent), data from
``synthetic_batches``, so two calls with the same arguments start from the same state.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from primuspipe.testing.megatron import tiny_models

T = TypeVar("T")


@dataclass(frozen=True)
class StepSpec:
    model: tiny_models.TinyModelConfig
    num_microbatches: int
    seed: int = 0
    ddp: bool = False
    """Wrap chunks in Megatron DDP and finalize grads (``finalize_model_grads``) as training does."""
    optimizer_step: bool = False
    """Then take an SGD step (needs ``ddp``)."""
    forward_only: bool = False
    lr: float = 0.1
    config_overrides: Mapping[str, Any] = field(default_factory=dict)
    placement: str = "interleaved"
    """How chunks map to stages: ``"interleaved"`` (Megatron's) or ``"v"`` (V-shape tables, vpp=2); see
    :func:`placement_of` for a table's."""
    ddp_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Megatron ``DistributedDataParallelConfig`` fields, e.g. ``overlap_grad_reduce``,
    ``use_distributed_optimizer``, ``overlap_param_gather``, ``bucket_size``; the distributed optimizer
    is then the optimizer too."""
    optimizer: str = "sgd"
    """Megatron's ``OptimizerConfig.optimizer``: ``"sgd"`` (no momentum) or ``"adam"``."""
    clip_grad: float = 0.0
    """Megatron's ``OptimizerConfig.clip_grad`` (global gradient-norm clipping; 0 = off)."""
    align_grad_reduce: bool = True
    """Megatron-LM's ``--align-grad-reduce`` (its default): under ``overlap_grad_reduce`` the schedule gets
    each chunk's ``start_grad_sync`` as ``grad_sync_func``; ``False`` leaves the start to DDP's hooks."""


@dataclass
class StepResult:
    losses: list
    """The forward-backward function's return value (loss dicts on the last stage, ``[]`` elsewhere)."""
    grads: dict[str, torch.Tensor | None]
    """Global parameter name -> gradient (``main_grad`` under DDP)."""
    params: dict[str, torch.Tensor]
    step_time_s: float
    """Wall time of the forward-backward call alone."""


def placement_of(table) -> str:
    """The :attr:`StepSpec.placement` that builds model chunks for ``table`` (a primuspipe table)."""
    from primuspipe.errors import ConfigError, TableFormatError
    from primuspipe.ir.placement import Placement

    for name in tiny_models.PLACEMENTS:
        with contextlib.suppress(TableFormatError):
            if table.placement == Placement.named(name, table.pp, table.vpp):
                return name
    raise ConfigError(f"{table.algorithm}: no way to build Megatron chunks for its {table.placement.name!r} placement")


def build(spec: StepSpec, pp: int, vpp: int, device: torch.device | None = None):
    """``(config, chunks, model)``: the Megatron config, raw chunks, and what the schedule is given.

    Tensor- and (for MoE models) expert-parallel sizes come from ``parallel_state``; its virtual pipeline size is set to
    ``vpp`` (Megatron's own schedules read it there), so one process group serves any vpp."""
    from megatron.core import parallel_state

    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    overrides = dict(spec.config_overrides)
    ep = 1
    if spec.model.num_moe_experts:
        ep = parallel_state.get_expert_model_parallel_world_size()
        overrides.setdefault("expert_tensor_parallel_size", parallel_state.get_expert_tensor_parallel_world_size())
    config = tiny_models.transformer_config(spec.model, pp, vpp, tp=parallel_state.get_tensor_model_parallel_world_size(),
                                            ep=ep, placement=spec.placement, **overrides)
    chunks = tiny_models.build_model_chunks(spec.model, config, seed=spec.seed, placement=spec.placement)
    if device is not None:
        chunks = [c.to(device) for c in chunks]
    modules = chunks
    if config.bf16 or config.fp16:  # as megatron.training's get_model: 16-bit parameters, fp32 at the ends
        from megatron.core.transformer.module import Float16Module

        modules = [Float16Module(config, c) for c in chunks]
    if not spec.ddp:
        return config, chunks, modules
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": False, "overlap_grad_reduce": False,
                                                  "use_distributed_optimizer": False, **spec.ddp_overrides})
    wrapped = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(modules)]
    wire_ddp(config, wrapped, spec.align_grad_reduce)
    for m in wrapped:
        m.zero_grad_buffer()
    return config, chunks, wrapped


def wire_ddp(config, wrapped: list, align_grad_reduce: bool = True) -> None:
    """Set Megatron's schedule hooks on ``config`` for DDP-wrapped chunks as ``megatron.training``'s
    ``setup_model_and_optimizer``/``train`` do (with its default ``align_param_gather``): ``no_sync_func``; ``grad_sync_func`` under ``overlap_grad_reduce``;
    ``param_sync_func`` under ``overlap_param_gather``; ``finalize_model_grads``."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(funcs):
        return funcs if len(funcs) > 1 else funcs[0]

    ddp = wrapped[0].ddp_config
    config.no_sync_func = per_chunk([m.no_sync for m in wrapped])
    aligned = ddp.overlap_grad_reduce and align_grad_reduce
    config.grad_sync_func = per_chunk([m.start_grad_sync for m in wrapped]) if aligned else None
    config.param_sync_func = per_chunk([m.start_param_sync for m in wrapped]) if ddp.overlap_param_gather else None
    config.finalize_model_grads_func = finalize_model_grads


def _config_of(model: list):
    from megatron.core.utils import get_model_config

    return get_model_config(model[0])


def make_optimizer(spec: StepSpec, model: list):
    """Megatron's optimizer for ``spec`` (SGD without momentum or Adam, ``clip_grad``, fp32 main parameters,
    bf16 ones where the model's config says so; distributed when the DDP config says so)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    distributed = bool(spec.ddp_overrides.get("use_distributed_optimizer", False))
    return get_megatron_optimizer(
        OptimizerConfig(optimizer=spec.optimizer, lr=spec.lr, weight_decay=0.0, clip_grad=spec.clip_grad, sgd_momentum=0.0,
                        params_dtype=torch.float32, use_distributed_optimizer=distributed,
                        bf16=bool(getattr(_config_of(model), "bf16", False))), model)


def batches(spec: StepSpec, device: torch.device | None = None):
    """The step's microbatches on ``device``. To a GPU they go as Megatron's data loader sends them (pinned
    host memory, ``non_blocking``): a copy from pageable memory waits for the stream, so each microbatch would
    start from an empty queue -- idle GPU time a lent H100 showed growing with the sequence length (the
    s x s mask), which no training run has (docs/projection.md)."""
    cuda = device is not None and device.type == "cuda"
    for batch in tiny_models.synthetic_batches(spec.model, spec.num_microbatches, seed=spec.seed):
        if device is None:
            yield batch
        else:
            yield {k: (v.pin_memory() if cuda else v).to(device, non_blocking=cuda) for k, v in batch.items()}


def call_schedule(schedule: Callable, spec: StepSpec, model, device: torch.device | None = None) -> tuple[list, float]:
    """Call ``schedule`` once on ``model`` (the chunks :func:`build` returned) as Megatron's training loop
    does -- model and data iterators are lists only with more than one chunk -- and return its result
    and the wall time of the call alone (the device synchronised on both sides)."""
    iterators = [batches(spec, device) for _ in model]
    interleaved = len(model) > 1
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses = schedule(
        forward_step_func=tiny_models.forward_step,
        data_iterator=iterators if interleaved else iterators[0],
        model=model if interleaved else model[0],
        num_microbatches=spec.num_microbatches,
        seq_length=spec.model.seq_length,
        micro_batch_size=spec.model.micro_batch_size,
        forward_only=spec.forward_only,
    )
    if cuda:
        torch.cuda.synchronize()
    return losses, time.perf_counter() - start


def shard_name(chunk, local_name: str, param: torch.Tensor) -> str:
    """The parameter's global name, plus ``@tp<rank>`` for a tensor-parallel shard of a dense weight (the
    same on every layout of that tensor-parallel size; experts are already named globally)."""
    from megatron.core import parallel_state

    name = tiny_models.global_param_name(chunk, local_name)
    sharded = getattr(param, "tensor_model_parallel", False) and getattr(param, "allreduce", True)
    if sharded and parallel_state.get_tensor_model_parallel_world_size() > 1:
        name += f"@tp{parallel_state.get_tensor_model_parallel_rank()}"
    return name


def param_grads(chunks, ddp: bool, shards: bool = False) -> dict[str, torch.Tensor | None]:
    """Global parameter name (:func:`shard_name` with ``shards``) -> a copy of its gradient (``main_grad``
    under DDP)."""
    grads = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            g = p.main_grad if ddp else p.grad
            key = shard_name(chunk, name, p) if shards else tiny_models.global_param_name(chunk, name)
            grads[key] = None if g is None else g.detach().to("cpu", copy=True)  # off the device the run measures
    return grads


def run_step(schedule: Callable, spec: StepSpec, pp: int, vpp: int, device: torch.device | None = None) -> StepResult:
    """Build the model, run ``schedule`` once as Megatron's training loop calls it, collect results."""
    config, chunks, model = build(spec, pp, vpp, device)
    losses, elapsed = call_schedule(schedule, spec, model, device)
    grads = param_grads(chunks, spec.ddp)
    if spec.optimizer_step:
        make_optimizer(spec, model).step()
    params = {tiny_models.global_param_name(c, n): p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    return StepResult([_detach(loss) for loss in losses], grads, params, elapsed)


def _detach(item):
    if isinstance(item, dict):
        return {k: _detach(v) for k, v in item.items()}
    return item.detach().cpu().clone() if isinstance(item, torch.Tensor) else item


def max_abs_diff(a: Mapping[str, torch.Tensor | None], b: Mapping[str, torch.Tensor | None]) -> float:
    """Largest absolute difference over tensors present in both (``inf`` if one side lacks a value)."""
    worst = 0.0
    for name in a.keys() & b.keys():
        x, y = a[name], b[name]
        if x is None or y is None:
            if x is not y:
                return float("inf")
            continue
        worst = max(worst, (x.float() - y.float()).abs().max().item())
    return worst


def merge_ranks(parts: Iterable[Mapping[str, T]]) -> dict[str, T]:
    """Fold per-pipeline-rank ``{global name: value}`` maps into what one pp=1 model holds; a name on two
    ranks is a harness bug (a data-parallel replica passed in, or a wrong global name)."""
    merged: dict[str, T] = {}
    for part in parts:
        for name, value in part.items():
            assert name not in merged, f"{name} held by two pipeline ranks"
            merged[name] = value
    return merged


@dataclass
class TrainResult:
    losses: list[list]
    """Per iteration, the forward-backward function's loss dicts (``[]`` off the loss rank)."""
    grads: list[dict[str, torch.Tensor | None]]
    """Per iteration, :func:`param_grads` by shard name after the forward-backward call (the
    reduced gradients: under the distributed optimizer only this rank's shard of each bucket is reduced)."""
    params: dict[str, torch.Tensor]
    """Shard name -> parameter after the last step, all-gathered where the distributed optimizer left
    the gather to the next forward (``overlap_param_gather``)."""
    step_times: list[float]
    start: int = 0
    """The first iteration run (a loaded checkpoint's)."""


@contextlib.contextmanager
def manual_gc(interval: int | None):
    """Megatron-LM's ``--manual-gc``: Python's automatic garbage collector off while the block runs and a
    collection after every ``interval``-th step (0: none between steps), so a collection never lands
    inside a step's nodes. None: the collector as it is. A full collection in a megatron-core process
    takes 100-170 ms of CPU; on CPU runs it landed on one node of a step in every few steps, which a
    timed step then carries (docs/simulator.md, "Accuracy"). Yields ``step_done(step)``, to call after
    each step (counted from 0).

    >>> with manual_gc(2) as step_done:
    ...     off = not gc.isenabled()
    ...     step_done(0); step_done(1)
    >>> off, gc.isenabled()
    (True, True)
    """
    if interval is None:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()

    def step_done(step: int) -> None:
        if interval and (step + 1) % interval == 0:
            gc.collect()

    try:
        yield step_done
    finally:
        if was_enabled:
            gc.enable()


def train(schedule: Callable, spec_for: Callable[[int], StepSpec], pp: int, vpp: int, iterations: int,
          device: torch.device | None = None, model=None, load: str | None = None,
          save: str | None = None, manual_gc_interval: int | None = None,
          grads_kept: int | None = None) -> TrainResult:
    """Training steps up to iteration ``iterations`` as Megatron's loop takes them: zero the grad buffers
    and the optimizer, the forward-backward call, the optimizer step. Iteration ``i`` draws
    ``spec_for(i)``'s data; the model (``spec_for(0)``'s, or ``model`` = what :func:`build` returned)
    and the optimizer are built once. ``load``: start from that checkpoint (:func:`load_checkpoint`, any
    schedule saved it) at its iteration; ``save``: save one there after the last step.
    ``manual_gc_interval``: Python's garbage collector as :func:`manual_gc` runs it (None: automatic).
    ``grads_kept``: keep the gradients of the first that many iterations only (None: every iteration's). Each
    kept iteration holds a copy of the rank's gradients -- a model's worth of memory a step (13 MB at the
    prediction benches' hidden 256, pp = 2) -- which a long timed run must not grow by: the growing heap
    slowed later steps' backwards by 5-15 % at pp = 4 on a 2-core host, which no measurement of the early
    steps could predict (docs/replanning.md)."""
    spec = spec_for(0)
    config, chunks, wrapped = model if model is not None else build(spec, pp, vpp, device)
    optimizer = make_optimizer(spec, wrapped)
    result = TrainResult([], [], {}, [])
    result.start = load_checkpoint(load, wrapped, optimizer) if load else 0
    with manual_gc(manual_gc_interval) as step_done:
        for it in range(result.start, iterations):
            for m in wrapped:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            losses, seconds = call_schedule(schedule, spec_for(it), wrapped, device)
            result.losses.append([_detach(loss) for loss in losses])
            if grads_kept is None or len(result.grads) < grads_kept:
                result.grads.append(param_grads(chunks, ddp=True, shards=True))
            result.step_times.append(seconds)
            optimizer.step()
            step_done(it)
    if save:
        if torch.distributed.get_rank() == 0:
            os.makedirs(save, exist_ok=True)
        torch.distributed.barrier()
        save_checkpoint(save, wrapped, optimizer, iterations)
    if spec.ddp_overrides.get("overlap_param_gather"):
        for m in wrapped:
            m.start_param_sync(force_sync=True)
    result.params = {shard_name(c, n, p): p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    return result


CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                       "chained_optim_avoid_prefix": True}
"""What Megatron-LM's ``--dist-ckpt-optim-fully-reshardable`` passes to ``sharded_state_dict``: the
distributed optimizer's state is saved per parameter in model space, so any parallel layout (other pp,
vpp, placement, DP) can load it; the default ``dp_reshardable`` form keeps the pipeline layout."""


def _inner(module):
    """The model inside DDP and Float16Module wrappers (what Megatron-LM's ``unwrap_model`` returns)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _checkpoint_state(wrapped: list, optimizer, loading: bool) -> dict:
    """Megatron-LM's ``generate_state_dict`` layout: ``model`` (or ``model0``, ``model1``, ... with several
    chunks; each the chunk inside its DDP wrapper, as Megatron-LM unwraps it) and ``optimizer``. Tensors are keyed by their global names (layer numbers are global), so the
    keys do not depend on the schedule."""
    names = ["model"] if len(wrapped) == 1 else [f"model{i}" for i in range(len(wrapped))]
    state = {name: _inner(m).sharded_state_dict(metadata=CHECKPOINT_METADATA) for name, m in zip(names, wrapped)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=CHECKPOINT_METADATA)
    return state


def save_checkpoint(directory: str, wrapped: list, optimizer, iteration: int) -> None:
    """Save the model chunks and the optimizer with Megatron's distributed checkpointing (``torch_dist``
    format) into ``directory`` (created empty by rank 0 beforehand); every rank calls it."""
    from megatron.core import dist_checkpointing

    state = _checkpoint_state(wrapped, optimizer, loading=False)
    state["iteration"] = iteration
    dist_checkpointing.save(state, directory)


def load_checkpoint(directory: str, wrapped: list, optimizer) -> int:
    """Load what :func:`save_checkpoint` wrote -- under any schedule, placement or vpp -- into freshly
    built ``wrapped`` chunks and their optimizer; returns the saved iteration."""
    from megatron.core import dist_checkpointing

    template = _checkpoint_state(wrapped, optimizer, loading=True)
    template["iteration"] = 0
    state = dist_checkpointing.load(template, directory)
    names = ["model"] if len(wrapped) == 1 else [f"model{i}" for i in range(len(wrapped))]
    for name, m in zip(names, wrapped):
        _inner(m).load_state_dict(state[name], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["iteration"])
