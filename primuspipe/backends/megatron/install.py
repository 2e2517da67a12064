"""Install primuspipe into Megatron: replace ``get_forward_backward_func`` everywhere it is bound.

``megatron.core.pipeline_parallel.get_forward_backward_func`` is replaced (and the same name in
``megatron.core.pipeline_parallel.schedules``); ``megatron.training.training`` binds the name at import
time, so its copy is replaced too when that module is already loaded (install before importing it and
it picks up the patched one). :func:`uninstall` puts Megatron's function back in every one of these
modules that holds an installed one, including ``megatron.training.training`` imported after
``install``. The replacement keeps Megatron's signature and returns a primuspipe
:class:`~primuspipe.backends.megatron.schedule_func.PrimusForwardBackward` whenever there is a pipeline
to schedule (pp > 1); with pp = 1 or multi-module process groups it returns Megatron's own function.

``megatron.training``'s ``get_model`` is wrapped too (when ``megatron.training.training`` is imported
before ``install``, as Megatron-LM scripts do): for a V-shape table (zbv, v-half, v-min,
dualpipe-v) it hands the user's unchanged ``model_provider`` to Megatron's ``get_model`` wrapped by
:func:`~primuspipe.backends.megatron.v_placement.v_model_provider`, so the two chunks of each rank are the
V's stages (layers, ``pre_process``/``post_process``, tied embeddings, checkpoint names), and Megatron's
per-chunk stage queries answer for the V, so the script's data pipeline feeds the V's first and last
stage (:func:`~primuspipe.backends.megatron.v_placement.answer_stage_queries_for_v`).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import Any, Optional

from primuspipe import strict
from primuspipe.backends.megatron.config import SETTINGS, PrimusPipeConfig, load_config
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
from primuspipe.backends.megatron.v_placement import answer_stage_queries_for_v, restore_stage_queries, v_model_provider
from primuspipe.errors import ConfigError
from primuspipe.ir.placement import Placement

logger = logging.getLogger(__name__)

_BOUND_IN = ("megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules", "megatron.training.training")
_NAME = "get_forward_backward_func"
_native: list = []
"""Megatron's own ``get_forward_backward_func`` while primuspipe is installed (one entry)."""


def _megatron_schedules():
    """megatron-core's ``pipeline_parallel`` and ``schedules`` modules. megatron-core 0.19 imports triton
    there unguarded, which a CPU build of torch does not bring: trying primuspipe on a laptop, a first user
    met triton's ModuleNotFoundError deep in Megatron, where one line can name CPU mode, which stubs it."""
    try:
        from megatron.core import pipeline_parallel
        from megatron.core.pipeline_parallel import schedules
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        raise ConfigError("megatron-core imports triton, which this torch does not have (a CPU build?): without a "
                          "GPU, call primuspipe.backends.megatron.cpu_mode.enable_cpu_mode() before install() "
                          "(docs/megatron.md, 'CPU mode')") from None
    return pipeline_parallel, schedules


def install(config: PrimusPipeConfig | None = None, **overrides: Any) -> PrimusForwardBackward | None:
    """Patch Megatron per ``config`` (default: :func:`load_config`, i.e. YAML and environment).

    Returns the installed forward-backward function, or ``None`` when ``patch_primus_pipeline`` is off.
    Installing again replaces the previous installation. Bad settings fail here, not on every rank at
    step 1: an unknown algorithm or option (:meth:`PrimusPipeConfig.check`), a dump directory that cannot
    be written, a NaN or infinite watchdog timeout.
    """
    config = strict.instance(config, PrimusPipeConfig, "install()'s config") if config is not None else load_config()
    strict.keys(overrides, "install()'s settings", allowed=SETTINGS)  # a misspelt one named with the closest
    # an override is the caller's value: a refusal of it must not name the variable or file it replaced
    config = replace(config, **overrides, sources={k: v for k, v in config.sources.items() if k not in overrides})
    if not config.patch_primus_pipeline:
        logger.info("primuspipe: patch_primus_pipeline is off; Megatron's schedules stay in place")
        return None
    config.check()
    pipeline_parallel, schedules = _megatron_schedules()

    if not _native:
        _native.append(schedules.get_forward_backward_func)
    native = _native[0]
    func = PrimusForwardBackward(config)

    def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None,
                                  schedule_pg_collection=None):
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

        if isinstance(schedule_pg_collection, MultiModuleProcessGroupCollection):
            return native(pp_size, vp_size, schedule_pg_collection)
        if pp_size is None and vp_size is None:
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        return func if pp_size > 1 else native(pp_size, vp_size, schedule_pg_collection)

    _install_get_model(func)
    _install_model_builder(func)
    get_forward_backward_func.__doc__ = native.__doc__
    get_forward_backward_func.primuspipe = func  # type: ignore[attr-defined]
    for name in _BOUND_IN:
        module = sys.modules.get(name) if name == "megatron.training.training" else {
            "megatron.core.pipeline_parallel": pipeline_parallel, "megatron.core.pipeline_parallel.schedules": schedules}[name]
        if module is None or not hasattr(module, _NAME):
            continue
        setattr(module, _NAME, get_forward_backward_func)
    logger.info("primuspipe: Megatron's %s now runs %s tables", _NAME, config.pp_algorithm)
    return func


def _training_module():
    """``megatron.training.training`` if the script imported it (Megatron-LM scripts import
    ``megatron.training`` at the top, before they could call :func:`install`); ``None`` otherwise."""
    return sys.modules.get("megatron.training.training")


def _install_get_model(func: PrimusForwardBackward) -> None:
    """Wrap ``megatron.training``'s ``get_model`` so that, when the configured algorithm's table for the
    run's shape places stages in a V, the user's own ``model_provider`` builds the V chunks
    (:func:`~primuspipe.backends.megatron.v_placement.v_model_provider`): nothing in the training script
    changes. Other placements get Megatron's ``get_model`` untouched."""
    training = _training_module()
    if training is None or not hasattr(training, "get_model"):
        return
    if _native_get_model:
        _restore_get_model()
    native = training.get_model
    _native_get_model[:] = [(training, native)]

    def get_model(model_provider_func, *args, **kwargs):
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_world_size()
        rank = parallel_state.get_pipeline_model_parallel_rank()
        if _runs_v(func, pp, training.get_args().virtual_pipeline_model_parallel_size):
            model_provider_func = v_model_provider(model_provider_func, pp, rank)
        return native(model_provider_func, *args, **kwargs)

    get_model.__doc__ = native.__doc__
    get_model.primuspipe = func  # type: ignore[attr-defined]
    training.get_model = get_model


def _runs_v(func: PrimusForwardBackward, pp: int, vpp: Optional[int]) -> bool:
    """Whether the run's table places two chunks per rank in a V (then Megatron's per-chunk stage queries
    answer for the V from now on, :func:`answer_stage_queries_for_v`); refused in one line when the table is
    a V but the run does not build two chunks per rank."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    restore_stage_queries()
    table = func.table_for(pp, vpp, get_num_microbatches()) if pp > 1 else None
    if table is None or not (table.placement == Placement.vshape(pp) and table.vpp == 2):
        return False
    if vpp != 2:
        raise ConfigError(f"{table.algorithm} places two model chunks per rank in a V; set "
                          "--num-virtual-stages-per-pipeline-rank 2 (virtual_pipeline_model_parallel_size=2)")
    answer_stage_queries_for_v(pp)
    return True


def _install_model_builder(func: PrimusForwardBackward) -> None:
    """The same for ``pretrain`` given a model config (``GPTModelConfig``/``HybridModelConfig`` in the
    config container) instead of a ``model_provider``: its builder builds the chunks through
    ``megatron.training.models.dist_utils.build_virtual_pipeline_stages``, whose ``build_model_func``
    takes the provider's keywords; for a V it gets the V stage's. Like ``get_model``, wrapped when the
    script already imported ``megatron.training`` (which imports that module)."""
    dist_utils = sys.modules.get("megatron.training.models.dist_utils")
    if dist_utils is None:
        return
    if _native_builder:
        _restore_model_builder()
    native = dist_utils.build_virtual_pipeline_stages
    _native_builder[:] = [(dist_utils, native)]

    def build_virtual_pipeline_stages(build_model_func, pg_collection, vp_size, *args, **kwargs):
        pp, rank = pg_collection.pp.size(), pg_collection.pp.rank()
        if _runs_v(func, pp, vp_size):
            build_model_func = v_model_provider(build_model_func, pp, rank)
        return native(build_model_func, pg_collection, vp_size, *args, **kwargs)

    build_virtual_pipeline_stages.__doc__ = native.__doc__
    dist_utils.build_virtual_pipeline_stages = build_virtual_pipeline_stages


_native_builder: list = []
"""``(megatron.training.models.dist_utils, its own build_virtual_pipeline_stages)`` while wrapped."""


def _restore_model_builder() -> None:
    if _native_builder:
        module, native = _native_builder.pop()
        module.build_virtual_pipeline_stages = native


_native_get_model: list = []
"""``(megatron.training.training, its own get_model)`` while primuspipe's wraps it (one entry)."""


def _restore_get_model() -> None:
    if _native_get_model:
        training, native = _native_get_model.pop()
        training.get_model = native


def uninstall() -> None:
    """Put Megatron's own ``get_forward_backward_func`` back wherever an installed one is bound, also in
    modules that imported it after :func:`install` (``megatron.training.training``), and its own
    ``get_model``."""
    _restore_get_model()
    _restore_model_builder()
    restore_stage_queries()
    if not _native:
        return
    for name in _BOUND_IN:
        module = sys.modules.get(name)
        if module is not None and hasattr(getattr(module, _NAME, None), "primuspipe"):
            setattr(module, _NAME, _native[0])
    _native.clear()


def is_installed() -> bool:
    return bool(_native)
