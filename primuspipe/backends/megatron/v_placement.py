"""Build Megatron model chunks for the V placement (ZBV, V-half, V-min, DualPipe-V).

In a V-shape table rank ``r`` runs stage ``r`` as chunk 0 and stage ``2p-1-r`` as chunk 1, so rank 0
holds both the first stage (embedding) and the last (output layer and loss). Megatron places model
chunk ``c`` of rank ``r`` at stage ``c*p + r`` (its layer offsets, ``pre_process`` and ``post_process``
follow that), and its ``pipeline_model_parallel_layout`` cannot express V either: the layout assigns
layers to (rank, virtual stage) pairs but always orders the pairs as ``vp_stage * p + rank``, so it
can change how many layers a stage holds, not which stage a chunk is.

**Which layers a V chunk holds.** The V of ``p`` ranks folds a ``2p``-stage pipeline: chunk ``c`` of
rank ``r`` is V stage ``s`` (``r`` for c = 0, ``2p-1-r`` for c = 1) and holds the layers Megatron's own
split gives pipeline stage ``s`` of ``2p`` (:func:`v_stage_layers`): even stages, uneven first/last stage
(``num_layers_in_first/last_pipeline_stage`` count the V's stage 0 and stage ``2p-1``), and
``account_for_embedding/loss_in_pipeline_split`` (one layer fewer on stage 0 / ``2p-1``). A split the V
cannot hold (the layers left after the first/last stage do not divide over the middle stages) and a
``pipeline_model_parallel_layout`` (its stage ``i`` is rank ``i % p``, chunk ``i // p`` by Megatron's
definition) are refused in one line. :func:`v_layer_offsets` makes Megatron's own
``get_transformer_layer_offset`` and ``get_num_layers_to_build`` answer so while a chunk is built (and while its ``sharded_state_dict`` is taken, which recomputes the
offsets), and :func:`v_stage_flags` gives the ``pre_process`` / ``post_process`` flags.

The user's ``model_provider`` stays as it is: :func:`v_model_provider` wraps it, and ``install()`` hands
the wrapped provider to ``megatron.training``'s ``get_model`` when the run's table is a V, so
``get_model`` builds the V chunks (with ``virtual_pipeline_model_parallel_size=2``).

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from primuspipe.errors import ConfigError
from primuspipe.ir.placement import Placement

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


_LAYER_FUNCTIONS = (("megatron.core.transformer.transformer_layer", "get_transformer_layer_offset"),
                    ("megatron.core.transformer.transformer_block", "get_num_layers_to_build"))
"""Megatron's functions that decide which layers a chunk builds (defined where listed; also replaced
wherever another loaded megatron module imported them by name)."""


def _stage_view(config: Any, pp: int) -> Any:
    """The config of the ``2p``-stage pipeline the V folds onto ``p`` ranks: Megatron's layer split of its
    stage ``s`` is the V's stage ``s`` (``num_layers_in_first/last_pipeline_stage`` are the V's first and
    last stage, ``account_for_embedding/loss_in_pipeline_split`` count stage 0 and stage ``2p-1``)."""
    import copy

    if config.pipeline_model_parallel_layout is not None:
        raise ConfigError("the V placement cannot take pipeline_model_parallel_layout (Megatron maps its stage i to "
                          "rank i % pp, chunk i // pp, the interleaved order); unset it and give the V's first and "
                          "last stage their counts with num_layers_in_first/last_pipeline_stage")
    if (config.virtual_pipeline_model_parallel_size or 1) != 2:
        raise ConfigError("the V placement needs virtual_pipeline_model_parallel_size=2 (two chunks per rank; "
                          "Megatron-LM: --num-virtual-stages-per-pipeline-rank 2)")
    view = copy.copy(config)
    view.pipeline_model_parallel_size = 2 * pp
    view.virtual_pipeline_model_parallel_size = None
    return view


def v_stage_layers(config: Any, pp: int) -> tuple[range, ...]:
    """The global layer numbers (0-based) of each V stage ``0 .. 2p-1``: what Megatron's own
    ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` give stage ``s`` of the ``2p``-stage
    pipeline the V folds. Raises :class:`ConfigError` (one line) when Megatron cannot split the layers so,
    or the stages would not hold every layer exactly once."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    view = _stage_view(config, pp)
    stages = []
    for stage in range(2 * pp):
        try:
            offset = _ORIGINALS.get("get_transformer_layer_offset", get_transformer_layer_offset)(view, None, stage)
            count = _ORIGINALS.get("get_num_layers_to_build", get_num_layers_to_build)(view, None, stage)
        except AssertionError as exc:
            raise ConfigError(f"the V placement folds {2 * pp} pipeline stages onto {pp} ranks, and Megatron cannot "
                              f"split num_layers={config.num_layers} over {2 * pp} stages so: {exc}".strip()) from None
        stages.append(range(offset, offset + count))
    covered = [layer for stage in stages for layer in stage]
    if covered != list(range(config.num_layers)):
        raise ConfigError(f"the V placement's {2 * pp} stages would hold layers {[list(s) for s in stages]}, not each of "
                          f"the {config.num_layers} layers once; change num_layers or the first/last stage counts")
    return tuple(stages)


_ORIGINALS: dict[str, Any] = {}
"""Megatron's layer functions while :func:`v_layer_offsets` is active."""


def _v_layer_functions(pp: int) -> dict[str, Any]:
    """Replacements of :data:`_LAYER_FUNCTIONS` that answer for the V stage of ``(rank, vp_stage)``."""
    from megatron.core import parallel_state

    def stage_of(config, vp_stage, pp_rank):
        if vp_stage not in (0, 1):
            raise ConfigError(f"a V-placement chunk is built with vp_stage 0 or 1, got {vp_stage!r}")
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        return v_stage_layers(config, pp), Placement.vshape(pp).stage(pp_rank, vp_stage)

    def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
        stages, stage = stage_of(config, vp_stage, pp_rank)
        return stages[stage].start

    def get_num_layers_to_build(config, vp_stage=None, pp_rank=None):
        stages, stage = stage_of(config, vp_stage, pp_rank)
        return len(stages[stage])

    return {"get_transformer_layer_offset": get_transformer_layer_offset,
            "get_num_layers_to_build": get_num_layers_to_build}


def _bindings(originals: dict[str, Any]) -> list[tuple[Any, str]]:
    """Every (loaded megatron module, name) that holds one of ``originals``."""
    import sys

    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron."):
            continue
        for name, function in originals.items():
            if getattr(module, name, None) is function:
                found.append((module, name))
    return found


@contextlib.contextmanager
def v_layer_offsets(pp: int) -> Iterator[None]:
    """Inside, Megatron's layer split answers for the V: a chunk (rank ``r``, ``vp_stage`` c) builds the
    layers of V stage ``r`` (c = 0) or ``2p-1-r`` (c = 1), as :func:`v_stage_layers` gives them; tied
    embeddings are set up on rank 0 without the embedding group (module docstring). Needed while building and while taking
    ``sharded_state_dict`` (distributed checkpointing recomputes the offsets); :func:`v_model_provider` does
    both."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    if _ORIGINALS:  # nested (a provider building inside get_model's wrapper)
        yield
        return
    for module_name, name in _LAYER_FUNCTIONS:
        with contextlib.suppress(ImportError):
            _ORIGINALS[name] = getattr(importlib.import_module(module_name), name)
    bound = _bindings(_ORIGINALS)
    replacements = _v_layer_functions(pp)
    setup = LanguageModule.setup_embeddings_and_output_layer
    for module, name in bound:
        setattr(module, name, replacements[name])
    LanguageModule.setup_embeddings_and_output_layer = _setup_tied_embeddings_locally(setup)
    try:
        yield
    finally:
        for module, name in bound:
            setattr(module, name, _ORIGINALS[name])
        _ORIGINALS.clear()
        LanguageModule.setup_embeddings_and_output_layer = setup


def v_model_provider(model_provider: Callable[..., Any], pp: int, rank: int) -> Callable[..., Any]:
    """Megatron's ``model_provider`` (as ``megatron.training``'s ``get_model`` calls it, once per
    ``vp_stage``) turned into one that builds the V: Megatron's ``pre_process``/``post_process`` are
    replaced by the V stage's (:func:`v_stage_flags`), the chunk is built inside :func:`v_layer_offsets`,
    and its ``sharded_state_dict`` runs inside it too, so a distributed checkpoint names each layer by its
    global number whatever the schedule. What :func:`~primuspipe.backends.megatron.install.install` hands
    ``get_model`` for V tables; the user's provider is unchanged."""

    def provider(*args: Any, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                 **kwargs: Any) -> Any:
        if vp_stage not in (0, 1):
            raise ConfigError(f"the V placement builds two chunks per rank (vp_stage 0 and 1), got vp_stage={vp_stage!r}; "
                              "set virtual_pipeline_model_parallel_size=2")
        pre_process, post_process = v_stage_flags(pp, rank, vp_stage)
        with v_layer_offsets(pp):
            chunk = model_provider(*args, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                                   **kwargs)
        sharded_state_dict = chunk.sharded_state_dict

        def v_sharded_state_dict(*a: Any, **k: Any) -> Any:
            with v_layer_offsets(pp):
                return sharded_state_dict(*a, **k)

        chunk.sharded_state_dict = v_sharded_state_dict
        return chunk

    return provider


def v_float16_boundaries(models: Sequence[Any], pp: int, rank: int) -> None:
    """Make each ``Float16Module`` in ``models`` (this rank's V chunks, as ``get_model`` wraps them under
    ``--bf16``/``--fp16``) cast at the V's ends: inputs to 16 bits on V stage 0, outputs back to fp32 on
    V stage ``2p-1``. Idempotent; the Megatron backend calls it at each step of a V table.

    Why: ``Float16Module.forward`` decides by Megatron's placement (chunk 0 of the first rank, chunk
    ``vpp-1`` of the last). In the V that upcasts the output of the last rank's chunk 1, a middle stage,
    so it sends fp32 where the next stage receives ``pipeline_dtype`` (gloo aborts on the size
    mismatch), and leaves the V's real last stage (chunk 1 of rank 0) in 16 bits, so its loss would be
    computed from bf16 logits."""
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    placement = Placement.vshape(pp)
    for model in models:
        for module in model.modules():
            if not isinstance(module, Float16Module) or "forward" in vars(module):
                continue
            stage = placement.stage(rank, module.vp_stage)

            def forward(*inputs: Any, fp32_output: bool = True, _m: Any = module, _first: bool = stage == 0,
                        _last: bool = stage == 2 * pp - 1, **kwargs: Any) -> Any:
                if _first:
                    inputs = fp32_to_float16(inputs, _m.float16_convertor)
                outputs = _m.module(*inputs, **kwargs)
                return float16_to_fp32(outputs) if _last and fp32_output else outputs

            module.forward = forward


_STAGE_QUERIES = ("is_pipeline_first_stage", "is_pipeline_last_stage")
_native_stage_queries: dict[str, Any] = {}
"""Megatron's own ``parallel_state`` stage queries while :func:`answer_stage_queries_for_v` is in force."""


def answer_stage_queries_for_v(pp: int) -> None:
    """Make ``parallel_state.is_pipeline_first_stage`` / ``is_pipeline_last_stage`` answer for the V when
    asked about a chunk (``ignore_virtual=False, vp_stage=c``): rank ``r``'s chunk ``c`` is the first stage
    iff it is V stage 0, the last iff V stage ``2p-1``.

    Why: a Megatron-LM script decides with these which chunks read data -- ``pretrain_gpt``'s
    ``get_batch`` (``is_first_or_last_pipeline_stage(vp_stage)``) and its dataset builder -- and
    Megatron's answer (chunk 1 of the last rank) is wrong for the V, whose last stage is chunk 1 of rank
    0: that chunk would get no labels and no loss mask. Questions about the rank (``ignore_virtual=True``,
    where ``train_step`` reduces and logs the loss) keep Megatron's answer; the backend hands the V's
    losses to the last rank (:mod:`~primuspipe.backends.megatron.last_stage`). Set by ``install()``'s
    ``get_model`` for V tables and undone by :func:`restore_stage_queries`."""
    from megatron.core import parallel_state

    restore_stage_queries()
    native = {name: getattr(parallel_state, name) for name in _STAGE_QUERIES}
    placement = Placement.vshape(pp)

    def v_answer(name: str) -> Callable[..., bool]:
        want = 0 if name == "is_pipeline_first_stage" else 2 * pp - 1

        def query(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
            if ignore_virtual or vp_stage is None:
                return native[name](ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            return placement.stage(parallel_state.get_pipeline_model_parallel_rank(), vp_stage) == want

        query.__doc__ = native[name].__doc__
        return query

    for name in _STAGE_QUERIES:
        setattr(parallel_state, name, v_answer(name))
    _native_stage_queries.update(native)


def restore_stage_queries() -> None:
    """Put Megatron's own stage queries back (no-op when they are in place)."""
    from megatron.core import parallel_state

    for name, query in _native_stage_queries.items():
        setattr(parallel_state, name, query)
    _native_stage_queries.clear()


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
