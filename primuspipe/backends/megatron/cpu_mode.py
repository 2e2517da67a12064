"""Run megatron-core 0.19 on CPU (gloo), for tests and for debugging a schedule on a laptop.

This is product code, not test tooling: ``primuspipe project --benchmark-layers`` times Megatron's layers
with it on a host without a GPU (:mod:`primuspipe.projection.benchmark.layers`), and ``examples/train_gpt.py``
trains with it there; the layers below ``testing/`` may not import that package. The test harnesses built on
it (process launch, one training step to compare) are in :mod:`primuspipe.testing.megatron`.

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
them instead of patching ``torch`` for the whole process (which would silently change user code).
Each shim below is a few lines, applies only after ``enable_cpu_mode()`` and only to megatron:

* **CUDA calls** -- the modules listed in ``CPU_MODE_PATCHED_MODULES`` build tensors on
  ``device="cuda"`` / ``torch.cuda.current_device()`` and call ``torch.cuda.synchronize`` / streams /
  events. Inside exactly those modules the global ``torch`` is rebound to :class:`_CpuTorch`, a thin
  proxy that forwards everything to the real ``torch`` except that CUDA devices passed to ``torch.*``
  functions become CPU and ``torch.cuda``'s device/stream/event/synchronisation calls are no-ops (on
  one CPU thread every op is already ordered; this is what lets the MoE alltoall dispatcher and the
  shared expert's side stream run). Tensors, classes and sub-packages are the real ones.
* **triton** -- ``megatron.core.transformer.moe.ops.paged_stash`` does ``import triton`` unguarded and
  is reached from ``pipeline_parallel.schedules``; when triton is missing that one module is replaced
  by a stub whose kernels raise if ever called (paged stash is a GPU-memory feature, off by default).
* **Sequence parallelism** -- Megatron's torch norm wrapper (``WrappedTorchNorm``, what the local
  spec uses without apex) refuses ``sequence_parallel``; its fused norm accepts it and marks its
  parameters ``sequence_parallel`` so ``finalize_model_grads`` all-reduces their gradients across
  tensor-parallel ranks. The shim builds the torch norm and marks the parameters the same way.
* **Gradient-accumulation fusion** -- without apex, ``fused_weight_gradient_mlp_cuda`` is missing and
  Megatron's linear layers refuse ``gradient_accumulation_fusion``. The shim gives
  ``megatron.core.tensor_parallel.layers`` a CPU stand-in (:class:`CpuWgradAccumulation`:
  ``main_grad += grad_output^T @ input``, the same GEMM and add as the unfused path, so results match it
  bit for bit).
* **Recompute** -- ``tensor_parallel.random`` saves and restores the CUDA generator around every
  checkpointed region (full and selective recompute). On CPU there is no CUDA generator: the shim makes
  those two functions save nothing and restore nothing (the CPU generator and the model-parallel RNG
  tracker are still saved and restored by Megatron's own code). Selective recompute of ``layernorm``
  (``CheckpointWithoutOutput``) takes Transformer Engine's FP8 path even for ``fp8=False`` (its test is
  ``fp8 is not None``); without TE the shim keeps it off the FP8 path unless FP8 was asked for. After
  recomputing, ``CheckpointWithoutOutput`` re-points the discarded output's storage at the recomputed
  one with a C++ extension it compiles on first use (a minute, and a compiler); the shim copies the
  recomputed bytes into that storage instead (same values, every view sees them).
* **MoE alltoall dispatcher** -- it moves its split sizes to the host as numpy arrays, but only when
  they are on a GPU (``maybe_move_tensor_to_cpu``); on CPU they stay tensors, which
  ``all_to_all_single`` refuses. The shim converts them as the GPU path does.
* **Tied embeddings with pp > 1** -- ``LanguageModule.setup_embeddings_and_output_layer`` moves the
  shared weight with ``.cuda()`` before its all-reduce. The shim runs that method under a
  :class:`~torch.overrides.TorchFunctionMode` in which ``Tensor.cuda`` returns the tensor itself (the
  mode is thread-local and active only during that call).
* **Distributed optimizer** -- ``DistributedOptimizer`` accepts only parameters whose ``type()`` names
  a CUDA tensor type, and moves its state to the GPU with ``.cuda()`` to gather it for a checkpoint. Its
  constructor, ``sharded_state_dict`` and ``load_state_dict`` run under :class:`_CpuTensorsAsCuda`
  (thread-local, those calls only), in which a CPU tensor's ``type()`` answers with the CUDA name and
  ``.cuda()`` with the tensor itself; so do the 16-bit optimizer's constructor (same ``type()`` test,
  ``bf16``/``fp16``) and gradient clipping (``clip_grad_by_total_norm_fp32`` asserts
  the CUDA type name of each gradient). Without Apex/TE it runs torch's Adam, whose ``step`` state
  megatron-core 0.19's checkpoint load mishandles twice (reads it from a fresh optimizer, looks for it
  among the saved tensors, hands all parameters one shared ``step`` tensor that Adam then increments
  once per parameter): the shim initialises a fresh Adam's state before the load template is built,
  skips ``step`` where saved tensors are copied in and gives each parameter its own ``step``.
* **Parameter all-gather on gloo** -- Megatron gathers a bucket group's parameters as one coalesced
  request, and gloo's fused all-gather corrupts the heap under torch 2.13; the shim issues those
  all-gathers one by one (:mod:`primuspipe.backends.megatron.gloo_all_gather`, same bytes).
* **Checkpoint writer without psutil** -- Megatron's distributed-checkpoint writer logs the process's
  resident memory with ``psutil`` and fails the save when it is missing; the shim reads it from
  ``/proc/self/statm`` then (Linux).
* **megatron.training on Python 3.11** -- ``megatron.training`` imports ``typing.override`` (3.12+).
  When it is missing the shim adds ``typing_extensions.override`` under that name, and
  ``megatron.training.utils.common_utils`` (reductions in ``train_step``) and
  ``megatron.training.training`` (``get_model``'s devices and streams) join the CUDA-call shim;
  ``get_model`` runs under :class:`_CudaIsCpu` (it moves each chunk with ``Module.cuda()``).

What the model must do itself (see ``tiny_models``): ``use_cpu_initialization=True``, fusions off,
and an explicit attention mask (the default causal mask is built on CUDA; ``megatron.training.pretrain``
on CPU, :mod:`primuspipe.testing.megatron.pretrain_cpu`, moves that one to CPU too). Gradient clipping
and bf16 run (see above and docs/megatron-lm.md).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import logging
import os
import sys
import types
import typing
from typing import Any, Callable

import torch

from primuspipe.backends.megatron import gloo_all_gather
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
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
)
"""Modules that hard-code CUDA on the paths a training step takes (schedules, p2p, DDP buffers,
grad finalisation, the optimizers, distributed checkpointing, multi-token prediction, the MoE router, dispatcher and shared expert, the
tensor-parallel layers, mappings and recompute). Nothing else is touched."""

CPU_MODE_PATCHED_TRAINING_MODULES: tuple[str, ...] = ("megatron.training.utils.common_utils",
                                                       "megatron.training.training")
"""The same for ``megatron.training`` (``train_step``'s model-parallel reductions, ``get_model``'s
streams and devices), when installed."""

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


class CpuWgradAccumulation:
    """CPU stand-in for apex's ``fused_weight_gradient_mlp_cuda`` (gradient-accumulation fusion):
    accumulate a linear layer's weight gradient straight into ``main_grad``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.add_(grad_output.t().to(main_grad.dtype).matmul(total_input.to(main_grad.dtype)))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


class _CudaIsCpu(torch.overrides.TorchFunctionMode):
    """``Tensor.cuda()`` returns the tensor itself (thread-local, only while the mode is entered)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


class _CpuTensorsAsCuda(_CudaIsCpu):
    """Also ``Tensor.type()`` (no argument) of a CPU tensor names its CUDA type, e.g.
    ``torch.cuda.FloatTensor`` (thread-local, only while the mode is entered)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not args[0].is_cuda:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return super().__torch_function__(func, types, args, kwargs)


_DISTRIBUTED_OPTIMIZER_METHODS = ("__init__", "sharded_state_dict", "load_state_dict")
"""The ``DistributedOptimizer`` methods that test ``type()`` names or call ``.cuda()`` (building it,
gathering and scattering its state for a checkpoint)."""


def _distributed_optimizer_takes_cpu_params() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def on_cpu(method):
        def call(*args, **kwargs):
            with _CpuTensorsAsCuda():
                return method(*args, **kwargs)

        call.__name__, call.__doc__ = method.__name__, method.__doc__
        return call

    for name in _DISTRIBUTED_OPTIMIZER_METHODS:
        setattr(DistributedOptimizer, name, on_cpu(getattr(DistributedOptimizer, name)))
    _distributed_optimizer_checkpoints_torch_adam(DistributedOptimizer)
    from megatron.core.optimizer import clip_grads, optimizer

    fp16_optimizer = optimizer.Float16OptimizerWithFloat16Params
    fp16_optimizer.__init__ = on_cpu(fp16_optimizer.__init__)
    clipping = on_cpu(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clipping


def _distributed_optimizer_checkpoints_torch_adam(cls) -> None:
    """Without Apex or Transformer Engine the distributed optimizer runs torch's Adam, whose per-parameter
    ``step`` megatron-core 0.19's checkpoint code trips over twice: building the load template reads the
    ``step`` of a fresh optimizer's (empty) state, and loading the per-parameter state then looks for a
    ``step`` among the saved tensors (it is restored from the parameter groups instead). The shim gives a
    fresh torch Adam its zero state (what its first ``step`` creates; the load overwrites it) and skips
    ``step`` where the saved tensors are copied in. The load also hands every parameter one shared
    ``step`` tensor, which torch's Adam increments in place once per parameter at each step (wrong bias
    correction from the second step on); the shim gives each parameter its own copy."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    sharded_state_dict, set_states = cls.sharded_state_dict, cls._set_main_param_and_optimizer_states

    def sharded_state_dict_loading_into_fresh_adam(self, model_sharded_state_dict, is_loading=False, *args, **kwargs):
        inner = self.optimizer
        if is_loading and isinstance(inner, torch.optim.Adam) and not inner.state and self.init_state_fn:
            self.init_state_fn(inner, self.config)
            for state in inner.state.values():
                state["step"] = torch.tensor(0.0)
        return sharded_state_dict(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    def set_states_without_step(self, model_param, tensors):
        return set_states(self, model_param, {"step": None, **tensors})

    load_state_dict = cls.load_state_dict

    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    cls.sharded_state_dict = sharded_state_dict_loading_into_fresh_adam
    cls._set_main_param_and_optimizer_states = set_states_without_step
    cls.load_state_dict = load_state_dict_with_own_steps


def _checkpoint_rss_without_psutil() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not filesystem_async.HAVE_PSUTIL:
        def _process_memory() -> int:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        filesystem_async._process_memory = _process_memory


def _rebind_torch(names: tuple[str, ...], proxy: _CpuTorch) -> None:
    for name in names:
        module = importlib.import_module(name)
        if isinstance(getattr(module, "torch", None), _CpuTorch):
            continue
        if getattr(module, "torch", None) is not torch:
            raise ConfigError(f"{name} has no global 'torch' to rebind; megatron-core version mismatch?")
        module.torch = proxy  # type: ignore[attr-defined]


def _sequence_parallel_torch_norms() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, *args, **kwargs)
        unmarked = copy.copy(config)
        unmarked.sequence_parallel = False
        norm = build(cls, unmarked, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # as Megatron's fused norm marks its weight and bias
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)


def _gradient_accumulation_fusion() -> None:
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = CpuWgradAccumulation
        layers._grad_accum_fusion_available = True


def _share_storage_by_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """What Megatron's compiled ``share_storage`` gives ``dst`` (the recomputed bytes in its own storage,
    seen by all its views), by a copy instead of a pointer swap: no C++ extension to compile."""
    storage = dst.untyped_storage()
    storage.resize_(src.untyped_storage().nbytes())
    storage.copy_(src.untyped_storage())


def _recompute_without_cuda_generator() -> None:
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    random._get_share_storage = lambda: _share_storage_by_copy
    if not hasattr(random, "FP8GlobalStateManager"):  # Transformer Engine is not installed
        init = random.CheckpointWithoutOutput.__init__

        def __init__(self, fp8=False):
            init(self, fp8)
            self.fp8 = fp8 not in (None, False)  # Megatron's `fp8 is not None` takes TE's FP8 path for False

        random.CheckpointWithoutOutput.__init__ = __init__


def _alltoall_splits_on_host() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()  # what the device-to-host copy gives on GPU
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _tied_embeddings_stay_on_cpu() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self) -> None:
        with _CudaIsCpu():
            setup(self)

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _megatron_training(proxy: _CpuTorch) -> None:
    if importlib.util.find_spec("megatron.training") is None:
        return
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    _rebind_torch(CPU_MODE_PATCHED_TRAINING_MODULES, proxy)
    from megatron.training import training

    get_model = training.get_model

    def get_model_on_cpu(*args, **kwargs):
        with _CudaIsCpu():  # it moves each chunk with Module.cuda()
            return get_model(*args, **kwargs)

    get_model_on_cpu.__doc__ = get_model.__doc__
    training.get_model = get_model_on_cpu


def enable_cpu_mode() -> None:
    """Make megatron-core's pipeline schedules, DDP, grad finalisation, the features of the module
    docstring and ``megatron.training``'s ``train_step`` run on CPU.

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
    _rebind_torch(CPU_MODE_PATCHED_MODULES, proxy)
    _sequence_parallel_torch_norms()
    _gradient_accumulation_fusion()
    _recompute_without_cuda_generator()
    _alltoall_splits_on_host()
    _tied_embeddings_stay_on_cpu()
    _distributed_optimizer_takes_cpu_params()
    _checkpoint_rss_without_psutil()
    gloo_all_gather.install()
    _megatron_training(proxy)
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
