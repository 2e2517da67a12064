"""Build Megatron model chunks for the V placement (ZBV, V-half, V-min, DualPipe-V).

In a V-shape table rank ``r`` runs stage ``r`` as chunk 0 and stage ``2p-1-r`` as chunk 1, so rank 0
holds both the first stage (embedding) and the last (output layer and loss). Megatron places model
chunk ``c`` of rank ``r`` at stage ``c*p + r`` (its layer offsets, ``pre_process`` and ``post_process``
follow that), and its ``pipeline_model_parallel_layout`` cannot express V either: the layout assigns
layers to (rank, virtual stage) pairs but always orders the pairs as ``vp_stage * p + rank``, so it
can change how many layers a stage holds, not which stage a chunk is.

Chunk 1 of rank ``r`` in the V is exactly the chunk Megatron would build as virtual stage 1 of rank
``p-1-r``. :func:`v_layer_offsets` makes Megatron's own ``get_transformer_layer_offset`` see that rank
for ``vp_stage == 1`` while the model is built (and while its ``sharded_state_dict`` is taken, which
recomputes the offset), and :func:`v_stage_flags` gives the ``pre_process`` / ``post_process`` flags.

A training script's ``model_provider`` does, for each ``vp_stage`` in ``(0, 1)``::

    pre, post = v_stage_flags(pp, pp_rank, vp_stage)
    with v_layer_offsets(pp):
        chunk = GPTModel(config, spec, ..., pre_process=pre, post_process=post, vp_stage=vp_stage)

with ``virtual_pipeline_model_parallel_size=2`` and untied embeddings (the word embedding and the
output layer are then both on rank 0, chunks 0 and 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from primuspipe.errors import ConfigError
from primuspipe.ir.placement import Placement

_OFFSET_MODULES = ("megatron.core.transformer.transformer_layer", "megatron.core.transformer.transformer_block")


def v_stage_flags(pp: int, rank: int, chunk: int) -> tuple[bool, bool]:
    """``(pre_process, post_process)`` of rank ``rank``'s chunk ``chunk`` in the V placement.

    >>> [v_stage_flags(2, r, c) for r in (0, 1) for c in (0, 1)]
    [(True, False), (False, True), (False, False), (False, False)]
    """
    stage = Placement.vshape(pp).stage(rank, chunk)
    return stage == 0, stage == 2 * pp - 1


@contextlib.contextmanager
def v_layer_offsets(pp: int) -> Iterator[None]:
    """Inside, Megatron numbers the layers of a ``vp_stage=1`` chunk of rank ``r`` as stage ``2p-1-r``."""
    import importlib

    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_layer

    original = transformer_layer.get_transformer_layer_offset

    def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
        if config.pipeline_model_parallel_layout or config.num_layers_in_first_pipeline_stage is not None \
                or config.num_layers_in_last_pipeline_stage is not None:
            raise ConfigError("the V placement is built with even stages; unset pipeline_model_parallel_layout and "
                              "num_layers_in_first/last_pipeline_stage")
        if (config.virtual_pipeline_model_parallel_size or 1) != 2:
            raise ConfigError("the V placement needs virtual_pipeline_model_parallel_size=2 (two chunks per rank)")
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vp_stage == 1:
            pp_rank = pp - 1 - pp_rank
        return original(config, vp_stage=vp_stage, pp_rank=pp_rank)

    modules = [importlib.import_module(name) for name in _OFFSET_MODULES]
    for module in modules:
        module.get_transformer_layer_offset = get_transformer_layer_offset
    try:
        yield
    finally:
        for module in modules:
            module.get_transformer_layer_offset = original
