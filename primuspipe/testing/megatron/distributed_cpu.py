"""Run a function on N CPU processes joined by gloo, with Megatron's ``parallel_state`` set up.

Public API
----------
``ParallelLayout(pp, vpp=1, dp=1, tp=1, ep=1, etp=1)``
    Frozen dataclass; ``world_size = pp * tp * dp``; expert parallelism (``ep`` x expert tensor
    parallelism ``etp``) is carved out of ``tp * dp``. Invalid sizes raise :class:`ConfigError`.
``WorkerContext``
    What the function receives in each process: ``rank``, ``world_size``, ``layout``, ``pp_rank``,
    ``dp_rank``, ``tp_rank``, ``ep_rank``, ``seed``.
``run_on_gloo(fn, layout, *, seed=0, timeout_s=120.0, start_method="fork") -> list``
    Calls ``fn(ctx)`` on every rank and returns the results ordered by global rank. ``fn``'s result
    must be picklable (tensors are fine). A rank that raises makes the call raise
    :class:`WorkerError` with that rank's traceback; a run longer than ``timeout_s`` is killed and
    raises :class:`primuspipe.errors.PipelineHangError`.
``WorkerError``
    From :mod:`primuspipe.testing.gloo`, which starts the processes and joins them with gloo.

Inside each worker, before ``fn``: what :func:`primuspipe.testing.gloo.run_gloo` does (one thread, a
gloo group on a private ``FileStore``), then :func:`enable_cpu_mode`, a thread queue for Megatron's
checkpoint writer (:func:`_checkpoint_writes_in_threads`), ``initialize_model_parallel(tp, pp, vpp,
ep, etp)`` and :func:`cpu_rng_seed`. After ``fn``, in every case: ``destroy_model_parallel`` and
``destroy_process_group``.

Why fork
--------
Importing megatron costs seconds per process; with ``start_method="fork"`` the parent imports it once
(``enable_cpu_mode`` runs in the parent first) and each launch costs about a second. ``fn`` may then be
any callable, closures included. ``"spawn"`` is available for hosts where forking a process that has
imported torch is unsafe; ``fn`` must then be importable by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed, enable_cpu_mode
from primuspipe.errors import ConfigError
from primuspipe.testing.gloo import WorkerError, run_gloo

T = TypeVar("T")

__all__ = ["ParallelLayout", "WorkerContext", "WorkerError", "run_on_gloo"]


@dataclass(frozen=True)
class ParallelLayout:
    """Process grid of one run."""

    pp: int
    """Pipeline-parallel size."""
    vpp: int = 1
    """Model chunks per pipeline rank (1 = no interleaving)."""
    dp: int = 1
    """Data-parallel size."""
    tp: int = 1
    """Tensor-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE)."""
    etp: int = 1
    """Expert tensor-parallel size; ``ep * etp`` must divide ``tp * dp``."""

    def __post_init__(self) -> None:
        for name in ("pp", "vpp", "dp", "tp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("vpp > 1 needs pp > 1 (Megatron has no interleaving without pipelining)")
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise ConfigError(f"ep*etp={self.ep * self.etp} must divide tp*dp={self.tp * self.dp}")

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp


@dataclass(frozen=True)
class WorkerContext:
    """Where the current worker sits; ``pp_rank``/``dp_rank`` come from Megatron's parallel_state."""

    rank: int
    world_size: int
    layout: ParallelLayout
    pp_rank: int
    dp_rank: int
    tp_rank: int
    ep_rank: int
    seed: int


def _checkpoint_writes_in_threads() -> None:
    """Megatron's distributed-checkpoint writer collects its writer threads' results in a queue it gets
    from a ``multiprocessing`` manager process -- made for asynchronous saves, and one a worker here
    cannot start (workers are daemonic processes). A synchronous save's writers are threads of this
    process, so a thread queue serves; asynchronous saves are not run in these workers."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _megatron_rank(fn: Callable[[WorkerContext], Any], layout: ParallelLayout, seed: int, rank: int,
                   world_size: int) -> Any:
    """Inside one gloo rank: CPU mode, Megatron's parallel state and RNG around ``fn``."""
    enable_cpu_mode()
    _checkpoint_writes_in_threads()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    try:
        cpu_rng_seed(seed)
        return fn(WorkerContext(rank=rank, world_size=world_size, layout=layout,
                                pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                                dp_rank=parallel_state.get_data_parallel_rank(),
                                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                ep_rank=parallel_state.get_expert_model_parallel_rank(), seed=seed))
    finally:
        parallel_state.destroy_model_parallel()


def run_on_gloo(
    fn: Callable[[WorkerContext], T],
    layout: ParallelLayout,
    *,
    seed: int = 0,
    timeout_s: float = 120.0,
    start_method: str = "fork",
) -> list[T]:
    """Run ``fn`` on ``layout.world_size`` gloo ranks; return each rank's result, by global rank."""
    if start_method == "fork":
        enable_cpu_mode()  # import megatron once, here, so children inherit it
    return run_gloo(functools.partial(_megatron_rank, fn, layout, seed), layout.world_size,
                    timeout_s=timeout_s, start_method=start_method)
