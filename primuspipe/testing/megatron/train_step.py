"""One call of ``megatron.training.training.train_step`` -- Megatron-LM's own training step: zero the
grad buffers, the forward-backward function, the optimizer step, the learning-rate scheduler, and the
loss reduction on the last pipeline stage -- on a tiny model, with a given forward-backward function.

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
    global_vars.set_args(args)
    if global_vars._GLOBAL_TIMERS is None:
        global_vars._set_timers(args)
    microbatches.destroy_num_microbatches_calculator()
    microbatches.init_num_microbatches_calculator(
        rank=torch.distributed.get_rank(), rampup_batch_size=None,
        global_batch_size=spec.num_microbatches * spec.model.micro_batch_size * data_parallel_size,
        micro_batch_size=spec.model.micro_batch_size, data_parallel_size=data_parallel_size)


def run_train_step(schedule: Callable, spec: compare.StepSpec, pp: int, vpp: int) -> TrainStepResult:
    """Build the model (DDP) and an SGD optimizer, call ``train_step`` once with ``schedule`` as the
    forward-backward function, and read what it returned, the gradients and the updated parameters."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training.training import train_step

    _set_globals(spec, parallel_state.get_data_parallel_world_size())
    config, chunks, model = compare.build(spec, pp, vpp)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=spec.lr, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0,
                        params_dtype=torch.float32), model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=spec.lr, max_lr=spec.lr, min_lr=spec.lr, lr_warmup_steps=0,
                                        lr_decay_steps=1, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1, wd_incr_style="constant")
    iterators = [compare.batches(spec) for _ in model]
    loss_dict, *_ = train_step(tiny_models.forward_step, iterators if len(model) > 1 else iterators[0], model,
                               optimizer, scheduler, config, schedule, iteration=0)
    params = {tiny_models.global_param_name(c, n): p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    return TrainStepResult({k: v.detach().clone() for k, v in loss_dict.items()}, compare.param_grads(chunks, True),
                           params)
