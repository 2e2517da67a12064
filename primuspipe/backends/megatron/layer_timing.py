"""How long each node of a recorded step spent inside the model's layer stack (the decoder).

A node's time is a chunk's fixed cost (``forward_step`` and the model's Python around its layers, the
autograd call, the pipeline hand-off; the embedding on the first stage, the output layer and loss on the
last) plus its layers' cost. A 1F1B run cannot tell the two apart, yet a schedule with ``vpp`` chunks per
rank pays the fixed cost ``vpp`` times per microbatch while its layers cost the same: cutting a 1F1B
stage's time evenly over its chunks predicts interleaved and V schedules too fast wherever the fixed cost
is not small. So, while a step is recorded, every chunk's decoder (megatron-core's ``TransformerBlock``)
is timed inside each node and reported to the recorder (:meth:`StepRecorder.layers
<primuspipe.runtime.recorder.StepRecorder.layers>`); calibration splits each node's time with it
(docs/simulator.md, "Calibration"):

* ``F``: the decoder's forward (module pre- and post-hooks);
* ``B`` / ``BW``: from the gradient of the decoder's output to that of its input (tensor hooks registered
  in the forward), the decoder's own backward;
* ``W``: the deferred weight-gradient GEMMs of the decoder's weights, each with the store's own work
  for it (:class:`~primuspipe.backends.megatron.wgrad_store.WeightGradStore`), and of their accumulation into
  the gradient buffers (one call for all of a microbatch's weights) the decoder weights' share of the
  elements.

The embedding (the first stage's own module) is timed the same way as ``ends``: its forward, and its
backward from the gradient of its output until its weights' gradients are accumulated (it has no input
gradient to end at), so calibration can tell the fixed cost every chunk pays from what the first model
stage pays on top. (Before its backward was timed, the 0.15 ms it took in a B of the bench's GPT at
hidden 128 counted as a cost every chunk pays: ``compute.chunk`` for B was twice a plain chunk's.) The
last stage's own work, the output layer and the loss, is not timed apart: the loss is computed outside any module (``forward_step``'s loss function), so
calibration takes the last stage's chunk cost from the other stages' (:mod:`primuspipe.calibration.measure`).

Only recorded steps are hooked (dumps and the re-planner's measured steps); hooks are removed when the
step ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def model_of(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The megatron-core model inside a (wrapped) chunk: the module holding a ``decoder``; None if none."""
    while not hasattr(chunk, "decoder"):
        if not hasattr(chunk, "module"):
            return None
        chunk = chunk.module
    return chunk


def parts_of(chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(part, module)`` of a chunk: its decoder (``layers``) and, on the first stage, its embedding
    (``ends``)."""
    model = model_of(chunk)
    if model is None:
        return []
    embedding = getattr(model, "embedding", None)
    return [("layers", model.decoder)] + ([("ends", embedding)] if isinstance(embedding, torch.nn.Module) else [])


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor a module takes or gives (the first of a tuple), if it carries a gradient. The first
    stage's decoder gets its input as megatron-core's ``WrappedTensor`` (one reference, for early
    freeing), which is looked into, not unwrapped."""
    value = value[0] if isinstance(value, (tuple, list)) and value else value
    wrapped = getattr(value, "_wrapper", None)
    value = wrapped[0] if isinstance(wrapped, list) and wrapped else value
    return value if isinstance(value, torch.Tensor) and value.requires_grad else None


@contextlib.contextmanager
def timing_layers(models: Sequence[torch.nn.Module], recorder: Any, wgrad: Any) -> Iterator[None]:
    """Report every span the enclosed step spends in a chunk's decoder (``layers``) or its embedding or
    output layer (``ends``) to ``recorder.inside``."""
    parts = [pair for chunk in models for pair in parts_of(chunk)]
    if not parts:
        yield
        return
    clock = recorder.clock
    handles = []

    def timed(part: str, module: torch.nn.Module) -> None:
        forward: list[Any] = []  # the running forward's start (one node at a time per process)
        backward: list[Any] = []  # the running backward's start and the node it was read in

        def output_grad(_grad):
            backward[:] = [(clock(), recorder.compute_nodes)]

        def input_grad(_grad):
            if backward:
                recorder.inside(part, backward.pop()[0], clock())

        def before(module, args, kwargs):
            tensor = _first_tensor(kwargs.get("hidden_states", args[0] if args else None))
            if part == "layers" and not getattr(module, "pre_process", True):
                tensor = _first_tensor(getattr(module, "input_tensor", None))  # what TransformerBlock runs on then
            if tensor is not None:
                tensor.register_hook(input_grad)
            forward[:] = [clock()]

        def after(module, args, kwargs, output):
            if forward:
                recorder.inside(part, forward.pop(), clock())
            if (tensor := _first_tensor(output)) is not None:
                tensor.register_hook(output_grad)

        def accumulated(_param):  # a module whose input has no gradient (the embedding): its backward
            # ends as its weights' gradients land, each span from the one before -- within the node its
            # backward began in: a weight whose gradient a later W accumulates (the output layer's, tied to the
            # word embedding on one rank) is that W's, which the weight-gradient store already reports
            if backward and backward[0][1] == recorder.compute_nodes:
                now = clock()
                recorder.inside(part, backward[0][0], now)
                backward[:] = [(now, recorder.compute_nodes)]
            else:
                backward.clear()

        handles.extend((module.register_forward_pre_hook(before, with_kwargs=True),
                        module.register_forward_hook(after, with_kwargs=True)))
        if part == "ends":
            handles.extend(p.register_post_accumulate_grad_hook(accumulated)
                           for p in module.parameters() if p.requires_grad)

    for part, module in parts:
        timed(part, module)
    wgrad.timed = ({id(p): part for part, module in parts for p in module.parameters()}, recorder)
    try:
        yield
    finally:
        wgrad.timed = None
        for handle in handles:
            handle.remove()
