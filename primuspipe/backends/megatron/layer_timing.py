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
* ``W``: the deferred weight-gradient GEMMs of the decoder's weights
  (:class:`~primuspipe.backends.megatron.wgrad_store.WeightGradStore`; their accumulation into the
  gradient buffers, one call for all of a microbatch's weights, stays in the fixed part).

Only recorded steps are hooked (dumps and the re-planner's measured steps); hooks are removed when the
step ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def decoder_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The layer stack of a (wrapped) megatron-core model chunk: its ``decoder``; None if it has none."""
    while not hasattr(model, "decoder"):
        if not hasattr(model, "module"):
            return None
        model = model.module
    return model.decoder


@contextlib.contextmanager
def timing_layers(models: Sequence[torch.nn.Module], recorder: Any, wgrad: Any) -> Iterator[None]:
    """Report every span the enclosed step spends in a chunk's decoder to ``recorder.layers``."""
    decoders = [d for d in map(decoder_of, models) if d is not None]
    if not decoders:
        yield
        return
    clock = recorder.clock
    entered: list[Any] = []  # the running forward's start (one node at a time per process)
    backward: list[Any] = []  # the running backward's start

    def output_grad(_grad):
        backward[:] = [clock()]

    def input_grad(_grad):
        if backward:
            recorder.layers(backward.pop(), clock())

    def before(module, args, kwargs):
        tensor = kwargs.get("hidden_states", args[0] if args else None)
        if not getattr(module, "pre_process", True):
            tensor = getattr(module, "input_tensor", None)  # what TransformerBlock runs on after stage 0
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(input_grad)
        entered[:] = [clock()]

    def after(module, args, kwargs, output):
        if entered:
            recorder.layers(entered.pop(), clock())
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(output_grad)

    handles = [h for d in decoders for h in (d.register_forward_pre_hook(before, with_kwargs=True),
                                             d.register_forward_hook(after, with_kwargs=True))]
    wgrad.timed = ({id(p) for d in decoders for p in d.parameters()}, recorder)
    try:
        yield
    finally:
        wgrad.timed = None
        for handle in handles:
            handle.remove()
