"""Megatron's contract for what a forward-backward call leaves behind: the loss dicts (or the data of
``collect_non_loss_data``) are returned on the last pipeline rank and ``[]`` elsewhere, and the step's
loss-token count (``calculate_per_token_loss``) is on the last pipeline rank, from where
``finalize_model_grads`` broadcasts it. ``train_step`` in ``megatron.training`` reduces and logs the
losses it finds there.

A table whose last stage is elsewhere -- the V placement computes the loss on rank 0 -- hands both to
the last rank after the step: :func:`hand_to_last_rank`. One small transfer per step between two ranks
(the structure as a pickled object, the tensors as one buffer per dtype), after every transfer of the
table has completed on both ranks, so it cannot overtake or be overtaken by them. A reported value
that cannot be pickled (a lambda in a loss dict, which Megatron's own schedules never send) is refused
on both ranks in one line; the last rank waited for it until the process group's timeout.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from primuspipe.errors import ConfigError


def _pack(store: list, tokens: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
    """``(skeleton, tensors)``: the pytree of ``(store, tokens)`` with each tensor leaf replaced by its
    ``(shape, dtype)``, and one flat buffer per dtype."""
    leaves, spec = pytree.tree_flatten((store, tokens))
    skeleton, by_dtype = [], {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = leaf.detach()
            by_dtype.setdefault(leaf.dtype, []).append(leaf.reshape(-1))
            skeleton.append(("tensor", tuple(leaf.shape), leaf.dtype))
        else:
            skeleton.append(("object", leaf))
    buffers = [torch.cat(parts) for parts in by_dtype.values()]
    return (spec, skeleton, list(by_dtype)), buffers


def _unpack(skeleton: Any, buffers: list[torch.Tensor]) -> tuple[list, torch.Tensor]:
    spec, leaves, dtypes = skeleton
    offsets = {dtype: 0 for dtype in dtypes}
    flat = dict(zip(dtypes, buffers))
    values = []
    for leaf in leaves:
        if leaf[0] == "object":
            values.append(leaf[1])
            continue
        _, shape, dtype = leaf
        size = int(torch.Size(shape).numel())
        values.append(flat[dtype][offsets[dtype]:offsets[dtype] + size].view(shape).clone())
        offsets[dtype] += size
    return pytree.tree_unflatten(values, spec)


def hand_to_last_rank(store: list, tokens: torch.Tensor, *, src: int, rank: int, group: Any,
                      device: torch.device) -> list:
    """Move the step's forward-data store and loss-token count from pipeline rank ``src`` (where the
    table's last stage ran) to the last pipeline rank. Returns what this rank's forward-backward call
    returns: ``[]`` on ``src``, the received store on the last rank (whose ``tokens`` tensor is set in
    place), ``store`` elsewhere."""
    last = group.size() - 1
    if src == last or rank not in (src, last):
        return store
    if rank == src:
        skeleton, buffers = _pack(store, tokens)
        try:
            message: Any = pickle.dumps(skeleton)
        except Exception as exc:  # noqa: BLE001 - whatever pickling raises, the last rank must hear of it
            message = (f"the loss function's reported values cannot be sent from pipeline rank {src}, where the "
                       f"table computes the loss, to the last pipeline rank {last}, where Megatron returns them: "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; report tensors, "
                       "numbers, strings and containers of them")
        dist.send_object_list([message], dst=dist.get_global_rank(group, last), group=group, device=device)
        if isinstance(message, str):
            raise ConfigError(message)
        for buffer in buffers:
            dist.send(buffer.to(device), dst=dist.get_global_rank(group, last), group=group)
        return []
    box = [None]
    dist.recv_object_list(box, src=dist.get_global_rank(group, src), group=group, device=device)
    if isinstance(box[0], str):  # the loss rank could not send them: both ranks refuse, neither waits
        raise ConfigError(box[0])
    skeleton = pickle.loads(box[0])
    _, leaves, dtypes = skeleton
    buffers = []
    for dtype in dtypes:
        numel = sum(int(torch.Size(leaf[1]).numel()) for leaf in leaves if leaf[0] == "tensor" and leaf[2] == dtype)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        dist.recv(buffer, src=dist.get_global_rank(group, src), group=group)
        buffers.append(buffer)
    received, count = _unpack(skeleton, buffers)
    tokens.copy_(count)
    return received
