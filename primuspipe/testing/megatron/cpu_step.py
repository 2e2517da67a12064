"""One Megatron training step of a tiny model on CPU ranks, reduced to comparable numbers.

Public API
----------
``PipelineCase(num_microbatches, model="tiny-gpt", schedule=None, seed=0, ddp=False,
optimizer_step=False, lr=0.1, config_overrides={})``
    One step to run. ``schedule`` is a forward-backward function with the keyword signature of
    ``megatron.core.pipeline_parallel.get_forward_backward_func()``'s result (``forward_step_func,
    data_iterator, model, num_microbatches, seq_length, micro_batch_size, ...``); ``None`` means
    Megatron's own schedule for the current layout.
``RankResult``
    ``rank, pp_rank, dp_rank, tp_rank, tp_size, losses`` (the schedule's return value: a list of
    ``{"lm loss": tensor([loss_sum, num_tokens])}`` on the last stage, ``[]`` elsewhere),
    ``grads`` and ``params`` (``{global parameter name: tensor}``; grads are ``main_grad`` under DDP,
    after ``finalize_model_grads``; params are read after the optimizer step, if any).
``run_pipeline_cases(layout, cases, *, timeout_s=120.0) -> list[list[RankResult]]``
    Runs every case, in order, inside one gloo launch (``[case][rank]``): a launch costs about a
    second, a case a fraction of that.
``merged_grads(results) -> dict[str, Tensor]``, ``merged_params(results)``, ``last_stage_losses(results)``
    Fold one case's per-rank results into what a pp=1 run of the same tensor-parallel size would report
    (names get ``@tp<rank>`` with tensor parallelism), for direct comparison.

The schedule is called exactly as Megatron's training loop calls it: model and data iterator are
lists when vpp > 1, ``config.no_sync_func`` / ``finalize_model_grads_func`` are set when ``ddp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from primuspipe.testing.megatron import compare, tiny_models
from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, WorkerContext, run_on_gloo
from primuspipe.errors import ConfigError

ForwardBackwardFunc = Callable[..., list]


@dataclass(frozen=True)
class PipelineCase:
    """One forward-backward (and optionally optimizer) step to run on every rank."""

    num_microbatches: int
    model: str = "tiny-gpt"
    """A key of :data:`tiny_models.TINY_MODELS`."""
    schedule: Optional[ForwardBackwardFunc] = None
    """Forward-backward function to test; ``None`` = ``get_forward_backward_func()``."""
    seed: int = 0
    """Seeds both the weights and the data."""
    ddp: bool = False
    """Wrap chunks in Megatron's ``DistributedDataParallel`` and finalize grads as training does."""
    optimizer_step: bool = False
    """Take an SGD step with ``get_megatron_optimizer`` (needs ``ddp``)."""
    lr: float = 0.1
    config_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields, e.g. ``{"batch_p2p_comm": True}``."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ConfigError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.optimizer_step and not self.ddp:
            raise ConfigError("optimizer_step needs ddp=True (Megatron's optimizer reads main_grad)")
        tiny_models.get_tiny_model(self.model)


@dataclass
class RankResult:
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    tp_size: int
    losses: list
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def _run_case(case: PipelineCase, ctx: WorkerContext) -> RankResult:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = compare.StepSpec(tiny_models.get_tiny_model(case.model), case.num_microbatches, seed=case.seed,
                            ddp=case.ddp, optimizer_step=case.optimizer_step, lr=case.lr,
                            config_overrides=case.config_overrides)
    result = compare.run_step(case.schedule or get_forward_backward_func(), spec, ctx.layout.pp, ctx.layout.vpp)
    return RankResult(ctx.rank, ctx.pp_rank, ctx.dp_rank, ctx.tp_rank, ctx.layout.tp, result.losses, result.grads,
                      result.params)


def run_pipeline_cases(
    layout: ParallelLayout, cases: Sequence[PipelineCase], *, timeout_s: float = 120.0
) -> list[list[RankResult]]:
    """Run ``cases`` one after another in a single launch; results are ``[case][rank]``."""
    cases = list(cases)
    enable_cpu_mode()
    # Import the model code in the parent so forked workers inherit it instead of re-importing.
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    per_rank = run_on_gloo(
        lambda ctx: [_run_case(case, ctx) for case in cases], layout, timeout_s=timeout_s
    )
    return [[rank_results[i] for rank_results in per_rank] for i in range(len(cases))]


def _merge(results: Sequence[RankResult], attr: str) -> dict[str, Optional[torch.Tensor]]:
    # Data-parallel replicas hold the same parameters: data-parallel rank 0 stands for them.
    def named(r: RankResult) -> dict:
        values = getattr(r, attr)
        return values if r.tp_size == 1 else {f"{name}@tp{r.tp_rank}": v for name, v in values.items()}

    return compare.merge_ranks(named(r) for r in results if r.dp_rank == 0)


def merged_grads(results: Sequence[RankResult]) -> dict[str, Optional[torch.Tensor]]:
    """All ranks' gradients under global names, as one pp=1 model would hold them."""
    return _merge(results, "grads")


def merged_params(results: Sequence[RankResult]) -> dict[str, Optional[torch.Tensor]]:
    return _merge(results, "params")


def last_stage_losses(results: Sequence[RankResult]) -> list:
    """The loss list of the last pipeline stage (data-parallel and tensor-parallel rank 0)."""
    last = max(r.pp_rank for r in results)
    (result,) = [r for r in results if r.pp_rank == last and r.dp_rank == 0 and r.tp_rank == 0]
    return result.losses
