"""``TorchPipeline``: run any primuspipe table on a plain PyTorch model split into stages.

Each rank builds the modules of the stages the table places on it (``table.placement.stages[rank]``;
:func:`split_sequential` cuts an ``nn.Sequential`` evenly) and calls :meth:`TorchPipeline.step` with
the whole batch, as with torch.distributed.pipelining: the rank holding the first stage splits its
inputs into the table's microbatches along dimension 0, the rank holding the last stage splits the
target the same way and returns the per-microbatch losses; other ranks may pass nothing.

Semantics match torch.distributed.pipelining's runtime on the same table (docs/torch.md): the same
forward and backward calls per node, losses from ``loss_fn(output, target)`` per microbatch, and, with
``scale_grads`` (the default), gradients divided by the microbatch count after each stage's last
weight gradient, so a mean loss per microbatch gives the gradient of the mean over the batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from primuspipe.backends.torch import data_parallel
from primuspipe.backends.torch.binder import StepData, TorchBinder
from primuspipe.backends.replanning import replanner_for
from primuspipe.backends.torch.meta import StageMeta, infer_stage_meta
from primuspipe.calibration.replan import ReplanSettings, check_settings_kind
from primuspipe.runtime.activation_offload import ActivationOffload, SavedBytes
from primuspipe.errors import ConfigError
from primuspipe import strict
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import validate
from primuspipe.runtime.driver import StepDriver
from primuspipe.runtime.recorder import checked_device


@dataclass(frozen=True)
class EvalOutput:
    """What :meth:`TorchPipeline.eval` returns on the rank holding the last stage."""

    output: Any
    """The last stage's outputs of all microbatches, concatenated along dimension 0."""
    losses: list[torch.Tensor] | None
    """Per microbatch loss, when a target was given (and a loss_fn)."""


class TorchPipeline:
    """This rank's share of a pipeline: its stage modules, run under ``table`` one step at a time.

    ``stages`` maps each stage index the table places on this rank to its module (wrapped in DDP or
    FSDP2 or not). ``group`` is the pipeline's process group (default: the whole world), ``device``
    where activations live (default: the first parameter's device). ``watchdog_timeout_s`` turns a
    transfer stuck that long into :class:`~primuspipe.errors.PipelineHangError`; ``dump_dir`` writes
    each step's timeline (``dump_pp_data``).

    A table with OFFLOAD/RELOAD nodes (:func:`~primuspipe.passes.offload.offload_activations`) moves
    saved activations to host memory and back (:mod:`primuspipe.runtime.activation_offload`): all that a
    chunk's forward saves, or with ``offload_ops`` only what submodules whose names contain one of them
    save. ``count_saved_bytes`` counts what autograd holds on the device even without offload
    (:attr:`saved_bytes`).

    ``auto_replan`` (True, or :class:`~primuspipe.calibration.replan.ReplanSettings`; default: the
    ``PRIMUSPIPE_AUTO_REPLAN*`` environment variables, off) measures the first steps and switches, at a step
    boundary, to the algorithm of the same layout the simulator ranks first under the measured costs
    (docs/replanning.md); :attr:`running_table` is the table steps run now, :attr:`replan_summary` the
    decision and how the steps after it compared with its prediction."""

    def __init__(self, table: ScheduleTable, stages: Mapping[int, torch.nn.Module], *,
                 loss_fn: Callable[..., torch.Tensor] | None = None, group: Any = None,
                 device: torch.device | str | None = None, scale_grads: bool = True,
                 watchdog_timeout_s: float = 300.0, dump_dir: str | None = None,
                 offload_ops: Sequence[str] = (), count_saved_bytes: bool = False,
                 auto_replan: bool | ReplanSettings | None = None):
        _check_arguments(table, stages, loss_fn)
        offload_ops, device = _check_options(scale_grads, count_saved_bytes, offload_ops, device, group)
        settings = ReplanSettings.from_env(os.environ) if auto_replan is None else check_settings_kind(auto_replan)
        self.driver = StepDriver(watchdog_timeout_s=watchdog_timeout_s, dump_dir=dump_dir)  # checks both now
        self.table = validate(table if table.has_communication else add_communication(table))
        if group is None and not dist.is_initialized():
            raise ConfigError("TorchPipeline runs on a process group, but torch.distributed is not initialised: call "
                              "torch.distributed.init_process_group(...) on every rank first, or pass group=")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if dist.get_world_size(self.group) != table.pp:
            raise ConfigError(f"the {table.algorithm} table has pp={table.pp} ranks but the pipeline group has "
                              f"{dist.get_world_size(self.group)}")
        mine = self.table.placement.stages[self.rank]
        if set(stages) != set(mine):  # numpy integers are stage numbers too
            raise ConfigError(f"pipeline rank {self.rank} holds stages {sorted(mine)} of the {table.algorithm} table "
                              f"({table.placement.name} placement), but was given modules for {sorted(stages)}")
        self.modules = [stages[s] for s in mine]
        """This rank's modules by chunk (``modules[c]`` is stage ``table.placement.stage(rank, c)``)."""
        # re-planning probes and may switch to W nodes
        data_parallel.check_wrappers(self.modules, settings.enabled or self.table.splits_backward)
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.device = device if device is not None else _device_of(self.modules)
        self.meta: list[StageMeta] | None = None
        """Per chunk, what its stage receives and sends; inferred at the first step or eval."""
        offloads = any(n.kind.on_host_stream for n in self.table.ranks[self.rank])
        if offload_ops and not offloads:
            raise ConfigError(f"offload_ops={list(offload_ops)} but rank {self.rank}'s row of the {table.algorithm} "
                              "table has no OFFLOAD nodes; run primuspipe.passes.offload.offload_activations on it")
        if offloads and any(data_parallel.fsdp_modules(m) for m in self.modules):
            raise ConfigError(f"rank {self.rank}'s row of the {table.algorithm} table offloads activations, but its "
                              "stages are FSDP2-sharded: FSDP frees and re-gathers the weights autograd saved, which "
                              "offload would copy; run the table without the offload pass, or without fully_shard")
        self.offload = (ActivationOffload(self.modules, self.device, offload_ops)
                        if offloads or count_saved_bytes else None)
        if settings.enabled and offloads:
            raise ConfigError("auto_replan cannot re-plan a table with OFFLOAD nodes (the candidates are built "
                              "without the offload pass); turn one of them off")
        if settings.enabled:  # the table is known now: candidates of another layout fail here, not at the first step
            settings.check_layout(self.table)
        self.replanner = replanner_for(settings, self.group, self.device, dump_dir)
        self.running_table = self.table
        """The table training steps run now: :attr:`table`, or what re-planning switched to."""

    @property
    def replan_summary(self) -> dict[str, Any] | None:
        """With ``auto_replan``: the decision (chosen algorithm, predicted step, ranking) and the measured
        steps after it; None before the decision or without re-planning."""
        return None if self.replanner is None else self.replanner.summary(self.table)

    @property
    def saved_bytes(self) -> SavedBytes | None:
        """What autograd held on the device during the last step (with offload or ``count_saved_bytes``)."""
        return None if self.offload is None else self.offload.saved

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.table.placement.stages[self.rank]

    @property
    def has_last_stage(self) -> bool:
        return self.table.num_stages - 1 in self.table.placement.stages[self.rank]

    def step(self, *inputs: torch.Tensor, target: Any = None) -> list[torch.Tensor] | None:
        """One training step on the whole batch: forwards, backwards and gradient accumulation as the
        table orders them. Returns the per-microbatch losses on the rank holding the last stage
        (None elsewhere). Gradients accumulate into ``.grad``; zero them before each step (with
        ``scale_grads`` the step divides ``.grad`` by the microbatch count)."""
        if self.loss_fn is None:
            raise ConfigError("step() trains, so it needs a loss_fn; pass one to TorchPipeline or call eval()")
        if not torch.is_grad_enabled():
            raise ConfigError("step() runs backward passes and cannot run under torch.no_grad(); call eval()")
        if self.scale_grads:
            self._refuse_stale_grads()
        binder = self._run(inputs, target, training=True)
        return [binder.losses[mb] for mb in range(self.table.microbatches)] if self.has_last_stage else None

    def eval(self, *inputs: torch.Tensor, target: Any = None) -> EvalOutput | None:
        """Forwards only (the table's forward-only view, no autograd graph). On the rank holding the
        last stage: the concatenated outputs, and the losses when a target is given."""
        with torch.no_grad():
            binder = self._run(inputs, target, training=False)
        if not self.has_last_stage:
            return None
        m = range(self.table.microbatches)
        outputs = [binder.outputs[mb] for mb in m]
        merged = (tuple(torch.cat(parts) for parts in zip(*outputs)) if isinstance(outputs[0], tuple)
                  else torch.cat(outputs))
        return EvalOutput(merged, [binder.losses[mb] for mb in m] if binder.losses else None)

    def _run(self, inputs: Sequence[torch.Tensor], target: Any, *, training: bool) -> TorchBinder:
        m = self.table.microbatches
        split_inputs = _split(inputs, m, "inputs") if self.has_first_stage else None
        targets = _split((target,), m, "target") if self.has_last_stage and target is not None else None
        if split_inputs is not None and targets is not None and len(inputs[0]) != len(target):
            raise ConfigError(f"the inputs have a batch of {len(inputs[0])} but the target {len(target)}; each "
                              "microbatch's target is the same rows of the batch as its inputs")
        if self.meta is None:
            self.meta = infer_stage_meta(self.modules, self.table.placement, self.rank,
                                         split_inputs[0] if split_inputs else None, self.group, self.device)
        if split_inputs is not None:
            self._check_inputs(split_inputs[0])
        loss_fn = self.loss_fn if training or targets is not None else None
        data = StepData(split_inputs, None if targets is None else [t for (t,) in targets], loss_fn, training,
                        m if self.scale_grads else 1)
        if self.offload is not None:
            self.offload.begin_step()
        plan = self.replanner.plan(self.table) if training and self.replanner is not None else None
        table = self.table if plan is None else plan.table
        binder = TorchBinder(table, self.rank, self.modules, self.meta, data, self.device, self.offload)
        view = self.driver.view(table, forward_only=not training)
        timeline = self.driver.execute(view, self.rank, binder, self.group, device=self.device,
                                       forward_only=not training, record=plan is not None and plan.record,
                                       dump_meta=None if plan is None else plan.dump_meta)
        binder.finish()
        if plan is not None:
            self.replanner.after_step(self.table, timeline)
            self.running_table = self.replanner.plan(self.table).table
        return binder

    def _check_inputs(self, first: tuple[torch.Tensor, ...]) -> None:
        want = self.meta[self.table.placement.locate(0)[1]].inputs
        got = [(tuple(t.shape), t.dtype) for t in first]
        if got != [(m.shape, m.dtype) for m in want]:
            raise ConfigError(f"a microbatch's inputs are {got}, but the pipeline's shapes were inferred at the first "
                              f"step as {[(m.shape, m.dtype) for m in want]}; every step must use the batch shape of "
                              "the first (build a new TorchPipeline for another shape)")

    def _refuse_stale_grads(self) -> None:
        for chunk, module in enumerate(self.modules):
            for name, p in module.named_parameters():
                if p.grad is not None:
                    raise ConfigError(
                        f"stage {self.table.placement.stage(self.rank, chunk)} parameter {name!r} already holds a "
                        "gradient at the start of step(); with scale_grads=True the step divides .grad by the "
                        "microbatch count (as torch.distributed.pipelining does), which would also divide that "
                        "gradient. Call optimizer.zero_grad() (set_to_none=True, the default) before each step, or "
                        "pass scale_grads=False and scale the loss yourself")


def _check_arguments(table: Any, stages: Any, loss_fn: Any) -> None:
    """Refuse, before any process-group call, arguments of the wrong type or value: each mistake one
    line naming the argument (rather than an AttributeError deep inside, or a failure after a step)."""
    if not isinstance(table, ScheduleTable):
        raise ConfigError(f"TorchPipeline's table must be a primuspipe ScheduleTable (build_schedule or load_table), "
                          f"got {type(table).__name__}")
    if not isinstance(stages, Mapping) or not all(isinstance(m, torch.nn.Module) for m in stages.values()):
        raise ConfigError("TorchPipeline's stages must map each stage number this rank holds to its torch.nn.Module, "
                          f"got {type(stages).__name__}"
                          + ("" if not isinstance(stages, Mapping) else
                             f" of {sorted({type(m).__name__ for m in stages.values()})}"))
    for key in stages:
        strict.count(key, "a TorchPipeline stage number")  # which stages: checked against the table below
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable (output, target) -> loss, got {type(loss_fn).__name__}")


def _check_options(scale_grads: Any, count_saved_bytes: Any, offload_ops: Any, device: Any, group: Any
                   ) -> tuple[tuple[str, ...], torch.device | None]:
    """The keyword options checked and read: a switch given as text (``"no"``, truthy) or None was read as on or
    off without a word, a string of op names as its characters, and a device or group torch cannot use was its
    RuntimeError or ValueError. Returns ``offload_ops`` as a tuple and the device, if given."""
    for name, value in (("scale_grads", scale_grads), ("count_saved_bytes", count_saved_bytes)):
        strict.of_type(value, bool, name)
    if isinstance(offload_ops, str) or not isinstance(offload_ops, Sequence) or \
            not all(isinstance(op, str) and op.strip() for op in offload_ops):
        raise ConfigError("offload_ops must be a list of submodule name parts (e.g. ['core_attention']), got "
                          f"{strict.show(offload_ops)}")
    if device is not None:
        device = checked_device(device)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ConfigError(f"group must be a torch.distributed ProcessGroup (e.g. dist.new_group(...)), got "
                          f"{strict.show(group)}")
    return tuple(offload_ops), device


def _split(values: Sequence[Any], m: int, what: str) -> list[tuple[torch.Tensor, ...]]:
    """``m`` microbatches of each tensor in ``values`` along dimension 0 (torch's ``tensor_split``),
    all of one size: a batch that does not divide into ``m`` is refused (unequal microbatches would
    give each a different weight in the mean, and shapes the pipeline did not infer)."""
    if not values:
        raise ConfigError(f"this rank holds the {'first' if what == 'inputs' else 'last'} stage, so step() needs "
                          f"the {what}")
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise ConfigError(f"the {what} must be tensors (split into microbatches along dimension 0), got "
                              f"{type(v).__name__}")
        if v.dim() == 0 or v.shape[0] < m:
            raise ConfigError(f"the {what} have a batch of {v.shape[0] if v.dim() else 0}, fewer than the table's "
                              f"{m} microbatches")
        if v.shape[0] % m:
            raise ConfigError(f"the {what} have a batch of {v.shape[0]}, which does not split into the table's {m} "
                              f"equal microbatches; give a batch that is a multiple of {m}")
    if len({v.shape[0] for v in values}) > 1:
        raise ConfigError(f"the {what} have batches of different sizes {[v.shape[0] for v in values]}; all split "
                          "along dimension 0 into the same microbatches")
    return list(zip(*(torch.tensor_split(v, m, dim=0) for v in values)))


def _device_of(modules: Sequence[torch.nn.Module]) -> torch.device:
    for module in modules:
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


@strict.arguments()
def split_sequential(model: torch.nn.Sequential, num_stages: int) -> list[torch.nn.Sequential]:
    """``model``'s layers cut into ``num_stages`` contiguous stages, as even as the layer count allows
    (earlier stages get the extra layers)."""
    layers = list(model)
    if not 1 <= num_stages <= len(layers):
        raise ConfigError(f"split_sequential cannot cut {len(layers)} layers into num_stages={num_stages} stages (each "
                          "needs at least one layer)")
    base, extra = divmod(len(layers), num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [torch.nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]
