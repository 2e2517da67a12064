"""Bytes an eager chain of PyTorch ops moves, as the aten operations it dispatches see them (for the time model's
element-wise figures, held against the real ops)."""

from __future__ import annotations


def byte_counter():
    """A dispatch mode that adds up the bytes of every aten operation's tensor inputs and outputs (views aside): what
    an element-wise chain of eager ops reads and writes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Moved(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs or {}, out))
                                  if isinstance(t, torch.Tensor))
            return out

    return Moved
