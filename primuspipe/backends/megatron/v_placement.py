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

with ``virtual_pipeline_model_parallel_size=2``.

**Tied embeddings** (``share_embeddings_and_output_weights=True``). Megatron keeps two copies of the
tied weight, the word embedding on the first stage and the output layer's on the last, made equal at
build time and kept equal by summing their gradients, both through its *embedding group* (the first
and the last pipeline rank). In the V both copies are on rank 0, so the group is the wrong set of ranks
(building the model with it waits forever for the last rank). Instead:

* at build time, inside :func:`v_layer_offsets`, Megatron's embedding set-up runs without the
  embedding group, and the output layer's copy (chunk 1, built after chunk 0 on rank 0, as Megatron's
  ``get_model`` builds chunks) is initialised from the word embedding -- the value Megatron's
  all-reduce of the zeroed copy with the embedding gives;
* after the backward, :func:`tied_embedding_grads` makes Megatron's ``finalize_model_grads`` sum the two
  copies' gradients on rank 0 (the same sum its all-reduce computes, at the same point) and skip the
  embedding group everywhere.

The Megatron backend does both by itself for V tables; no embedding group needs changing.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from primuspipe.errors import ConfigError
from primuspipe.ir.placement import Placement

_OFFSET_MODULES = ("megatron.core.transformer.transformer_layer", "megatron.core.transformer.transformer_block")

_embedding: list[weakref.ref] = []
"""The word-embedding weight of the last stage-0 chunk built in :func:`v_layer_offsets` (one entry)."""


def v_stage_flags(pp: int, rank: int, chunk: int) -> tuple[bool, bool]:
    """``(pre_process, post_process)`` of rank ``rank``'s chunk ``chunk`` in the V placement.

    >>> [v_stage_flags(2, r, c) for r in (0, 1) for c in (0, 1)]
    [(True, False), (False, True), (False, False), (False, False)]
    """
    stage = Placement.vshape(pp).stage(rank, chunk)
    return stage == 0, stage == 2 * pp - 1


def _setup_tied_embeddings_locally(setup):
    """Megatron's ``setup_embeddings_and_output_layer`` for a V chunk: no embedding-group all-reduce;
    the output layer's tied copy starts as the word embedding built before it on this rank."""
    import torch

    def setup_embeddings_and_output_layer(self) -> None:
        group, self.embd_group = self.embd_group, None
        try:
            setup(self)
        finally:
            self.embd_group = group
        if not self.share_embeddings_and_output_weights:
            return
        if self.pre_process:
            _embedding[:] = [weakref.ref(self.shared_embedding_or_output_weight())]
        elif self.post_process:
            embedding = _embedding[0]() if _embedding else None
            if embedding is None:
                raise ConfigError("tied embeddings in the V placement: build chunk 0 (the word embedding) before "
                                  "chunk 1 (the output layer) on rank 0, both inside v_layer_offsets")
            with torch.no_grad():
                self.shared_embedding_or_output_weight().copy_(embedding)

    return setup_embeddings_and_output_layer


@contextlib.contextmanager
def v_layer_offsets(pp: int) -> Iterator[None]:
    """Inside, Megatron numbers the layers of a ``vp_stage=1`` chunk of rank ``r`` as stage ``2p-1-r``,
    and ties embeddings on rank 0 without the embedding group (module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.language_module.language_module import LanguageModule
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
    setup = LanguageModule.setup_embeddings_and_output_layer
    for module in modules:
        module.get_transformer_layer_offset = get_transformer_layer_offset
    LanguageModule.setup_embeddings_and_output_layer = _setup_tied_embeddings_locally(setup)
    try:
        yield
    finally:
        for module in modules:
            module.get_transformer_layer_offset = original
        LanguageModule.setup_embeddings_and_output_layer = setup


def _shared_weight(chunk: Any) -> Any:
    """The tied weight of a chunk (word embedding or output layer), ``None`` if it has none."""
    while not hasattr(chunk, "share_embeddings_and_output_weights") and hasattr(chunk, "module"):
        chunk = chunk.module  # DDP / Float16Module wrappers
    if not getattr(chunk, "share_embeddings_and_output_weights", False):
        return None
    return chunk.shared_embedding_or_output_weight()


def tied_copies(models: Sequence[Any]) -> tuple[Any, Any] | None:
    """``(word embedding, output layer weight)`` when this rank holds both copies of a tied weight (rank 0
    in the V: chunk 0 and chunk 1), else ``None``."""
    if len(models) < 2:
        return None
    first, last = _shared_weight(models[0]), _shared_weight(models[-1])
    if first is None or last is None or first is last:
        return None
    return first, last


def _grad_of(weight: Any) -> Any:
    return weight.main_grad if hasattr(weight, "main_grad") else weight.grad


@contextlib.contextmanager
def tied_embedding_grads(models: Sequence[Any]) -> Iterator[None]:
    """Run ``finalize_model_grads`` inside: its word-embedding all-reduce becomes the sum of the two
    copies on the rank holding both, and nothing elsewhere. Raises :class:`ConfigError` afterwards if
    this rank holds both copies but the finalize function never reached that step (it is not
    Megatron's ``finalize_model_grads``), since the copies would then drift apart."""
    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    copies = tied_copies(models)
    summed = []

    def _allreduce_word_embedding_grads(model, config, embd_group=None, pp_group=None):
        if copies is None:
            return
        grads = [_grad_of(w) for w in copies]
        if all(g is not None for g in grads):
            total = grads[0] + grads[1]
            for grad in grads:
                grad.copy_(total)
        summed.append(True)

    original = module._allreduce_word_embedding_grads
    module._allreduce_word_embedding_grads = _allreduce_word_embedding_grads
    try:
        yield
    finally:
        module._allreduce_word_embedding_grads = original
    if copies is not None and not summed:
        raise ConfigError(
            "tied embeddings in the V placement: the word embedding and the output layer are both on this rank and "
            "their gradients are summed inside megatron.core.distributed.finalize_model_grads, but "
            "config.finalize_model_grads_func did not call it; call it from your finalize function")
