"""torch.distributed.pipelining side by side with primuspipe: its schedules' orders and its runtime.

Tests and benches compare primuspipe with torch's own pipelining on the same model and table:

* :func:`torch_orders`: the compute-only order (``pipeline_order``) and the communication-lowered
  order (``pipeline_order_with_comms``) a torch schedule class builds for a shape, as torch's CSV
  writer would write them, without processes or models (its schedules only read a stage's index,
  size and rank while building their orders);
* :func:`torch_runtime`: torch's ``_PipelineScheduleRuntime`` for this rank's stage modules, running a
  table from the CSV primuspipe writes for it (``_load_csv``, ``compute_comms``, default settings);
* :func:`torch_schedule`: one of torch's schedule classes on the same modules;
* :func:`plain_model`: the plain 8-layer model they run, and :func:`sequential_reference`, its
  gradients in one process.
"""

from __future__ import annotations

import csv
import io
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from primuspipe.io.formats import to_torch_csv
from primuspipe.passes.communication import add_communication
from primuspipe.ir.table import ScheduleTable

SCHEDULE_CLASSES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleLoopedBFS", "ScheduleInterleaved1F1B",
                    "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""Every schedule class torch 2.13 offers (``get_schedule_class``'s concrete ones)."""

V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def is_single_stage(name: str) -> bool:
    return issubclass(getattr(torch_schedules, name), torch_schedules.PipelineScheduleSingle)


def local_stage_indices(name: str, pp: int, vpp: int, rank: int) -> list[int]:
    """The stages torch's schedule ``name`` places on ``rank``."""
    if is_single_stage(name):
        return [rank]
    if name in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [c * pp + rank for c in range(vpp)]


class _StandIn:
    """What a torch schedule reads from a stage while it builds its order."""

    def __init__(self, index: int, num_stages: int, pp: int):
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, num_stages, 0, pp
        self.submod = torch.nn.Identity()


def torch_orders(name: str, pp: int, vpp: int, microbatches: int) -> tuple[str, str | None]:
    """The compute-only and the compute_comms CSV text of torch's schedule ``name`` for this shape.

    Single-stage classes (GPipe, 1F1B) have no lowering of their own; their compute_comms CSV is what
    torch's runtime lowers from their order (their ``REDUCE_GRAD`` dropped, which the lowering adds
    back), or None when torch cannot lower it."""
    num_stages = pp * (1 if is_single_stage(name) else vpp)
    cls = getattr(torch_schedules, name)
    loss = lambda out, target: out.sum()  # noqa: E731 - never called
    if is_single_stage(name):
        order = cls(_StandIn(0, num_stages, pp), microbatches, loss_fn=loss).pipeline_order
        runtime = torch_schedules._PipelineScheduleRuntime([_StandIn(0, num_stages, pp)], microbatches, loss_fn=loss)
        compute = {r: [a for a in row if a is None or a.computation_type != torch_schedules.REDUCE_GRAD]
                   for r, row in order.items()}
        try:
            runtime._prepare_schedule_with_comms(compute)
            comms = runtime.pipeline_order_with_comms
        except (AssertionError, RuntimeError, ValueError):
            comms = None
    else:
        stages = [_StandIn(i, num_stages, pp) for i in local_stage_indices(name, pp, vpp, 0)]
        schedule = cls(stages, microbatches, loss_fn=loss)
        order, comms = schedule.pipeline_order, schedule.pipeline_order_with_comms
    return _csv(order), None if comms is None else _csv(comms)


def _csv(order: Mapping[int, list]) -> str:
    out = io.StringIO()
    csv.writer(out).writerows(order[rank] for rank in sorted(order))
    return out.getvalue()


def _stages(modules: Mapping[int, torch.nn.Module], num_stages: int, group: Any, device: torch.device) -> list:
    return [PipelineStage(modules[s], s, num_stages, device, group=group) for s in sorted(modules)]


def torch_runtime(table: ScheduleTable, modules: Mapping[int, torch.nn.Module], loss_fn: Callable, *,
                  group: Any = None, device: torch.device | str = "cpu") -> Any:
    """torch's runtime for this rank's ``modules`` (stage -> module), running ``table`` from the
    compute_comms CSV primuspipe writes, with torch's default settings."""
    group = group if group is not None else dist.group.WORLD
    runtime = torch_schedules._PipelineScheduleRuntime(
        _stages(modules, table.num_stages, group, torch.device(device)), table.microbatches, loss_fn=loss_fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "schedule.csv"
        path.write_text(to_torch_csv(table if table.has_communication else add_communication(table)))
        runtime._load_csv(str(path), format="compute_comms")
    return runtime


def torch_schedule(name: str, modules: Mapping[int, torch.nn.Module], num_stages: int, microbatches: int,
                   loss_fn: Callable, *, group: Any = None, device: torch.device | str = "cpu") -> Any:
    """torch's schedule class ``name`` on this rank's ``modules`` (stage -> module), default settings."""
    group = group if group is not None else dist.group.WORLD
    stages = _stages(modules, num_stages, group, torch.device(device))
    cls = getattr(torch_schedules, name)
    return cls(stages[0] if is_single_stage(name) else stages, microbatches, loss_fn=loss_fn)


def torch_step(schedule: Any, rank_has_first: bool, rank_has_last: bool, inputs: tuple, target: Any) -> list | None:
    """One training step of a torch schedule; the losses on the rank with the last stage."""
    losses: list = [] if rank_has_last else None
    schedule.step(*(inputs if rank_has_first else ()), target=target if rank_has_last else None, losses=losses)
    return losses


def plain_model(hidden: int = 32, layers: int = 8, seed: int = 0) -> torch.nn.Sequential:
    """``layers`` blocks of Linear, GELU and LayerNorm; the same weights for the same seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                                     torch.nn.LayerNorm(hidden)) for _ in range(layers)])


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def sequential_reference(model: torch.nn.Module, inputs: torch.Tensor, target: torch.Tensor, microbatches: int,
                         loss_fn: Callable = mse) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-microbatch losses and the parameter gradients of ``model`` run in one process: each
    microbatch's mean loss, gradients divided by the microbatch count (torch's ``scale_grads``)."""
    losses = []
    for x, y in zip(inputs.tensor_split(microbatches), target.tensor_split(microbatches)):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.grad / microbatches for p in model.parameters()]
