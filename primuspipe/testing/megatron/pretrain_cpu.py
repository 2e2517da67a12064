"""``megatron.training.pretrain()`` on CPU/gloo: what it needs beyond :mod:`cpu_mode`.

Test tooling, not product. :func:`enable_pretrain_cpu_mode` turns on CPU mode (which already covers
megatron-core's schedules, DDP, optimizers, checkpointing and ``megatron.training.training``'s own
CUDA calls) and then patches, in ``megatron.training`` only:

1. The modules ``pretrain`` adds to a training step, :data:`PRETRAIN_CUDA_CALL_MODULES`, see
   ``torch`` through CPU mode's proxy (CUDA devices become CPU, streams and synchronisation are
   no-ops), with one device counted (``torch.cuda.is_available()`` True, ``device_count()`` 1) and an
   empty CUDA generator state (``get_rng_state`` an empty byte tensor, ``set_rng_state`` a no-op: there
   is no CUDA generator to save or restore; the CPU generator is still saved by Megatron's own code).
   Why each module: ``initialize`` asserts CUDA in ``initialize_megatron``, builds the model-parallel
   groups only when a device is counted, and seeds the model-parallel RNG tracker only then; Megatron's
   timers call ``torch.cuda.synchronize`` around each timed region; the rerun state machine saves the
   CUDA generator before every step and puts its result flags on ``device="cuda"``; checkpointing
   saves and restores the CUDA generator and puts the iteration on ``device="cuda"``; a middle stage
   gets no attention mask from ``pretrain_gpt``'s ``get_batch`` and builds Megatron's default causal
   mask (``transformer.utils.get_default_causal_mask``) on ``device="cuda"``; the loss scaler keeps its
   scale on ``device="cuda"``; the model builder (a ``GPTModelConfig`` instead of a ``model_provider``)
   creates a CUDA stream for DDP in ``models.dist_utils``. The process group
   is gloo through Megatron's own flag ``--distributed-backend gloo``.
2. ``_set_random_seed``'s ``tensor_parallel.model_parallel_cuda_manual_seed`` keeps its RNG-tracker
   states on the CPU generator (Megatron's ``inference_rng_tracker``, the same interface): the regular
   tracker snapshots CUDA generator states, which do not exist here. Seeds are unchanged.
3. ``megatron.core.datasets.utils.compile_helpers`` (called by ``initialize_megatron`` on rank 0) runs
   ``make`` in the installed package, but the megatron-core wheel ships the compiled
   ``helpers_cpp`` module and no Makefile, so ``make`` fails and the process exits. Not CPU-specific (any
   pip-installed megatron-core); it is skipped when ``helpers_cpp`` imports.
4. ``pretrain``'s ``set_jit_fusion_options`` warms up the fused bias-activation (GeLU, or SwiGLU with
   ``--swiglu``) and bias-dropout-add (``torch.compile``: Inductor generates and builds C++ for them, in every
   rank) whether or not the model runs them. Where both are off (the activation's fusion as Megatron's
   ``core_transformer_config_from_args`` picks it, and ``--no-bias-dropout-fusion``: the CPU runs' flags),
   nothing would use what it builds, so the warm-up is left out; either one on, it runs.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from primuspipe.backends.megatron import cpu_mode

PRETRAIN_CUDA_CALL_MODULES: tuple[str, ...] = ("megatron.training.initialize", "megatron.training.checkpointing",
                                               "megatron.core.timers", "megatron.core.rerun_state_machine",
                                               "megatron.core.transformer.utils", "megatron.core.optimizer.grad_scaler",
                                               "megatron.training.models.dist_utils")
"""Modules on ``pretrain``'s path that see one CPU "device" (item 1 of the module docstring)."""


class _OneDeviceCuda(cpu_mode._CpuCuda):
    """CPU mode's ``torch.cuda`` that also reports one device and an empty CUDA generator state."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        return None


class _OneDeviceTorch(cpu_mode._CpuTorch):
    def __init__(self) -> None:
        super().__init__()
        self.cuda = _OneDeviceCuda()


def _seed_tracker_on_cpu_generator(initialize: Any) -> None:
    seed = initialize.tensor_parallel.model_parallel_cuda_manual_seed
    if getattr(seed, "on_cpu_generator", False):
        return

    def model_parallel_cuda_manual_seed(seed_, te_rng_tracker=False, inference_rng_tracker=False, *args, **kwargs):
        return seed(seed_, False, True, *args, **kwargs)

    model_parallel_cuda_manual_seed.on_cpu_generator = True  # type: ignore[attr-defined]
    model_parallel_cuda_manual_seed.__doc__ = seed.__doc__
    initialize.tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


def _prebuilt_dataset_helpers() -> None:
    from megatron.core.datasets import utils

    compile_helpers = utils.compile_helpers

    def compile_unless_prebuilt() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            compile_helpers()

    compile_unless_prebuilt.__doc__ = compile_helpers.__doc__
    utils.compile_helpers = compile_unless_prebuilt


def _warm_up_only_fusions_in_use(training: Any) -> None:
    set_jit_fusion_options = training.set_jit_fusion_options
    if getattr(set_jit_fusion_options, "only_fusions_in_use", False):
        return

    def warm_up_fusions_in_use(*args, **kwargs) -> None:
        flags = training.get_args()
        if (flags.bias_swiglu_fusion if flags.swiglu else flags.bias_gelu_fusion) or flags.bias_dropout_fusion:
            set_jit_fusion_options(*args, **kwargs)

    warm_up_fusions_in_use.only_fusions_in_use = True  # type: ignore[attr-defined]
    warm_up_fusions_in_use.__doc__ = set_jit_fusion_options.__doc__
    training.set_jit_fusion_options = warm_up_fusions_in_use


def enable_pretrain_cpu_mode() -> None:
    """CPU mode plus the ``megatron.training`` patches of the module docstring. Idempotent."""
    cpu_mode.enable_cpu_mode()
    _seed_tracker_on_cpu_generator(importlib.import_module("megatron.training.initialize"))
    _prebuilt_dataset_helpers()
    _warm_up_only_fusions_in_use(importlib.import_module("megatron.training.training"))
    cpu_mode._rebind_torch(PRETRAIN_CUDA_CALL_MODULES, _OneDeviceTorch())
