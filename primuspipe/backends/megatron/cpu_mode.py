"""Run megatron-core 0.19 on CPU (gloo), for tests and for debugging a schedule on a laptop.

Public API
----------
``enable_cpu_mode() -> None``
    Idempotent. Call it before (or instead of) importing megatron's pipeline modules. Afterwards
    ``megatron.core.pipeline_parallel.get_forward_backward_func()``, Megatron's
    ``DistributedDataParallel``, ``finalize_model_grads`` and a CPU-friendly optimizer step run on CPU
    tensors over a gloo process group.
``is_cpu_mode_enabled() -> bool``
``cpu_rng_seed(seed: int) -> None``
    Megatron's model-parallel RNG set-up without a GPU; call after ``initialize_model_parallel``.
``CPU_MODE_PATCHED_MODULES``
    The megatron modules whose global name ``torch`` is rebound (see below).

Why this shape
--------------
megatron-core has no CPU switch, but only a few places stand in the way, so the fix is scoped to
them instead of patching ``torch`` for the whole process (which would silently change user code):

* ``megatron.core.transformer.moe.ops.paged_stash`` does ``import triton`` unguarded and is reached
  from ``pipeline_parallel.schedules``; when triton is missing that one module is replaced by a stub
  whose kernels raise if ever called (paged stash is a GPU-memory feature, off by default).
* The modules listed in ``CPU_MODE_PATCHED_MODULES`` build tensors on ``device="cuda"`` /
  ``torch.cuda.current_device()`` and call ``torch.cuda.synchronize`` / streams. Inside exactly
  those modules the global ``torch`` is rebound to :class:`_CpuTorch`, a thin proxy that forwards
  everything to the real ``torch`` except that CUDA devices passed to ``torch.*`` functions become
  CPU and ``torch.cuda``'s device/stream/synchronisation calls are no-ops. Tensors, classes and
  sub-packages (``torch.distributed``, ``torch.nn``) are the real ones.

What the model must do itself (see ``tiny_models``): ``use_cpu_initialization=True``, float32,
fusions off, an explicit attention mask (the default causal mask is built on CUDA), untied
embeddings when pp > 1 (tying calls ``.cuda()``), and ``clip_grad=0`` (grad-norm asserts CUDA).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import types
from typing import Any, Callable

import torch

from primuspipe.errors import ConfigError

logger = logging.getLogger(__name__)

CPU_MODE_PATCHED_MODULES: tuple[str, ...] = (
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.moe.router",
)
"""Modules that hard-code CUDA on the paths a training step takes (schedules, p2p, DDP buffers,
grad finalisation, the non-distributed optimizer, the MoE router). Nothing else is touched."""

_TRITON_MODULE = "megatron.core.transformer.moe.ops.paged_stash"

_enabled = False


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "cuda:<int>" to torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ``torch.*`` function so a CUDA ``device=`` argument lands on CPU."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "call")
    call.__doc__ = fn.__doc__
    return call


class _NullStream:
    """Stands in for a CUDA stream/event: on CPU every op is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullStream":
        return self

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _CpuCuda:
    """``torch.cuda`` as seen from a patched megatron module.

    Device/stream/synchronisation calls become CPU no-ops; ``is_available`` and everything else is
    the real ``torch.cuda`` so feature checks still tell the truth.
    """

    Stream = _NullStream
    Event = _NullStream

    synchronize = staticmethod(_noop)
    empty_cache = staticmethod(_noop)
    set_device = staticmethod(_noop)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        return _NullStream()

    @staticmethod
    def default_stream(device: Any = None) -> _NullStream:
        return _NullStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` as seen from a patched megatron module (see the module docstring)."""

    def __init__(self) -> None:
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if isinstance(value, (types.BuiltinFunctionType, types.FunctionType)):
            value = _on_cpu(value)
        # Cache so repeated look-ups in hot loops cost one dict access.
        setattr(self, name, value)
        return value


def _triton_stub() -> types.ModuleType:
    stub = types.ModuleType(_TRITON_MODULE)
    stub.__doc__ = "primuspipe CPU-mode stub: triton is not installed, paged-stash kernels are unavailable."
    stub.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("moe_paged_stash needs triton and a GPU; it is unavailable in CPU mode")

    stub.paged_stash_copy_kernel = unavailable  # type: ignore[attr-defined]
    stub.paged_stash_pop_kernel = unavailable  # type: ignore[attr-defined]
    stub.__all__ = [  # type: ignore[attr-defined]
        "GLOBAL_BLOCK_SIZE",
        "paged_stash_copy_kernel",
        "paged_stash_pop_kernel",
    ]
    return stub


def enable_cpu_mode() -> None:
    """Make megatron-core's pipeline schedules, DDP and grad finalisation run on CPU.

    Idempotent; safe to call in a parent before forking workers. Raises :class:`ConfigError` when
    megatron-core is not installed or a CUDA device is visible (CPU mode would then mix devices).
    """
    global _enabled
    if _enabled:
        return
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise ConfigError("CPU mode needs megatron-core (pip install megatron-core)")
    if torch.cuda.is_available():
        raise ConfigError(
            "CPU mode rebinds CUDA calls to CPU inside megatron; refusing while a CUDA device is "
            "visible (set CUDA_VISIBLE_DEVICES= to force CPU)"
        )
    if importlib.util.find_spec("triton") is None and _TRITON_MODULE not in sys.modules:
        sys.modules[_TRITON_MODULE] = _triton_stub()
        logger.debug("stubbed %s (triton missing)", _TRITON_MODULE)
    proxy = _CpuTorch()
    for name in CPU_MODE_PATCHED_MODULES:
        module = importlib.import_module(name)
        if isinstance(getattr(module, "torch", None), _CpuTorch):
            continue
        if getattr(module, "torch", None) is not torch:
            raise ConfigError(f"{name} has no global 'torch' to rebind; megatron-core version mismatch?")
        module.torch = proxy  # type: ignore[attr-defined]
    _enabled = True
    logger.info("megatron CPU mode enabled (patched: %s)", ", ".join(CPU_MODE_PATCHED_MODULES))


def is_cpu_mode_enabled() -> bool:
    return _enabled


def cpu_rng_seed(seed: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker without CUDA.

    Megatron's regular tracker snapshots CUDA RNG states; the inference tracker keeps the same
    interface on the CPU generator. ``force_reset_rng`` lets a forked worker re-seed a tracker that
    the parent may already have initialised.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
