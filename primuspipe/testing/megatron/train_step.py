"""Calls of ``megatron.training.training.train_step`` -- Megatron-LM's own training step: zero the
grad buffers, the forward-backward function, the optimizer step (gradient clipping, the distributed
optimizer's overlapped parameter gather), the learning-rate scheduler, and the loss reduction on the last
pipeline stage -- on a tiny model, with a given forward-backward function.

What Megatron-LM's ``pretrain`` sets up before it is set up here, minimally: the global arguments
(Megatron-LM's parser defaults plus the model's batch shape), timers, the microbatch calculator (one
global batch of ``num_microbatches`` microbatches per data-parallel rank) and a constant-LR scheduler.
Call inside an initialised process with CPU mode on (``megatron.training`` needs its shims on
Python 3.11).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from primuspipe.testing.megatron import compare, tiny_models


@dataclass
class TrainStepResult:
    loss_dict: dict
    """``train_step``'s reduced losses (``{}`` off the last pipeline stage)."""
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]


def _set_globals(spec: compare.StepSpec, data_parallel_size: int) -> None:
    from megatron.core import num_microbatches_calculator as microbatches
    from megatron.training import arguments, global_vars

    args = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args([])
    args.seq_length = spec.model.seq_length
    args.micro_batch_size = spec.model.micro_batch_size
    args.data_parallel_size = data_parallel_size
    args.gtp_weight_remat_size = 1  # derived by Megatron-LM's validate_args
    args.lr = spec.lr
    args.optimizer, args.clip_grad = spec.optimizer, spec.clip_grad
    for name in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"):
        setattr(args, name, bool(spec.ddp_overrides.get(name, False)))
    global_vars.set_args(args)
    if global_vars._GLOBAL_TIMERS is None:
        global_vars._set_timers(args)
    microbatches.destroy_num_microbatches_calculator()
    microbatches.init_num_microbatches_calculator(
        rank=torch.distributed.get_rank(), rampup_batch_size=None,
        global_batch_size=spec.num_microbatches * spec.model.micro_batch_size * data_parallel_size,
        micro_batch_size=spec.model.micro_batch_size, data_parallel_size=data_parallel_size)


def run_train_step(schedule: Callable, spec: compare.StepSpec, pp: int, vpp: int,
                   iterations: int = 1) -> TrainStepResult:
    """Build the model (DDP) and the optimizer ``spec`` asks for (:func:`compare.make_optimizer`), call
    ``train_step`` ``iterations`` times with ``schedule`` as the forward-backward function (iteration i
    draws seed i's data), and read what the last call returned, its gradients and the updated
    parameters (all-gathered where ``overlap_param_gather`` left that to the next forward)."""
    from dataclasses import replace

    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training.training import train_step

    _set_globals(spec, parallel_state.get_data_parallel_world_size())
    config, chunks, model = compare.build(spec, pp, vpp)
    optimizer = compare.make_optimizer(spec, model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=spec.lr, max_lr=spec.lr, min_lr=spec.lr, lr_warmup_steps=0,
                                        lr_decay_steps=1, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1, wd_incr_style="constant")
    for iteration in range(iterations):
        iterators = [compare.batches(replace(spec, seed=spec.seed + iteration)) for _ in model]
        loss_dict, *_ = train_step(tiny_models.forward_step, iterators if len(model) > 1 else iterators[0], model,
                                   optimizer, scheduler, config, schedule, iteration=iteration)
    if spec.ddp_overrides.get("overlap_param_gather"):
        for m in model:
            m.start_param_sync(force_sync=True)
    params = {tiny_models.global_param_name(c, n): p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    return TrainStepResult({k: v.detach().clone() for k, v in loss_dict.items()}, compare.param_grads(chunks, True),
                           params)
