"""Activation offload for the torch backends (plain torch, Megatron): what OFFLOAD and RELOAD nodes do, through
``torch.autograd.graph.saved_tensors_hooks``.

While a chunk runs a forward, every tensor autograd saves for the backward goes through :meth:`pack`
and is kept in a :class:`_Saved` holder filed under the (chunk, microbatch); autograd keeps only the
holder. ``OFFLOAD`` moves the holders' tensors to host memory and drops the device copies; ``RELOAD``
brings them back; the backward's :meth:`unpack` hands autograd the tensor on the device. Parameters
autograd saves (a linear layer's weight) stay where they are: they are not activations and the module
keeps them anyway.

* GPU: an offload copies device-to-host into pinned memory on a side stream (after the compute stream's
  work so far), and the device block returns to the allocator once that copy is done
  (``record_stream``); a reload copies host-to-device on a second side stream after the offload's copy,
  and the backward's unpack makes the compute stream wait for it. Compute never waits for a copy it
  does not consume.
* CPU: the same moves, as plain copies into separately allocated buffers; the original storage is
  released, so the bytes autograd holds really drop.

Which tensors move: all a chunk's forward saves (``ops`` empty), or only those saved while a submodule
whose qualified name contains one of ``ops`` runs (e.g. ``("mlp",)`` or ``("attention",)``); the
cost model's ``memory.offload_fraction`` should then say what share of the chunk's activations that is.

The holders also count what autograd holds on the device (:class:`SavedBytes`): the bytes now, the
step's peak, and what one forward of each chunk saves -- the figures the offload tests compare with the
simulator's prediction.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from primuspipe.errors import PrimusPipeError
from primuspipe.ir.kinds import NodeKind
from primuspipe.runtime.protocols import Handler

Key = tuple[int, int]
"""``(chunk, microbatch)``."""


class OffloadError(PrimusPipeError):
    """A backward found its activations on the host: its RELOAD did not run before it."""


@dataclass
class SavedBytes:
    """What autograd holds on the device, counted at every pack, offload, reload and release."""

    now: int = 0
    peak: int = 0
    per_forward: dict[int, int] = field(default_factory=dict)
    """chunk -> bytes one forward of it saved (its first microbatch's; every microbatch has one shape)."""
    movable_per_forward: dict[int, int] = field(default_factory=dict)
    """chunk -> of those, the bytes an OFFLOAD moves (all of them unless ``ops`` chose submodules)."""

    def moved_share(self) -> float | None:
        """The share of what forwards save that OFFLOAD moves -- what the cost model's
        ``memory.offload_fraction`` should say; ``None`` before any forward saved anything."""
        total = sum(self.per_forward.values())
        return sum(self.movable_per_forward.values()) / total if total else None

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


class _Saved:
    """One saved tensor as autograd keeps it: on the device, or on the host after an offload."""

    __slots__ = ("__weakref__", "counter", "device_tensor", "event", "host", "movable", "nbytes")

    def __init__(self, tensor: torch.Tensor, movable: bool, counter: SavedBytes):
        self.device_tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.event = None
        self.movable = movable
        self.nbytes = tensor.numel() * tensor.element_size()
        self.counter = counter
        counter.add(self.nbytes)

    def __del__(self) -> None:
        if self.device_tensor is not None:
            self.counter.now -= self.nbytes


class ActivationOffload:
    """Saved-tensor hooks over one rank's chunk modules, and the OFFLOAD / RELOAD moves; one per pipeline,
    :meth:`begin_step` before each step."""

    def __init__(self, modules: Sequence[torch.nn.Module], device: torch.device, ops: Sequence[str] = ()):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" names the current device; tensors say cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.ops = device, tuple(ops)
        self._parameters = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self._in_chosen_op = 0
        if self.ops:
            matched = [sub for m in modules for name, sub in m.named_modules() if any(op in name for op in self.ops)]
            if not matched:
                raise OffloadError(f"offload_ops {list(self.ops)} match no submodule of this rank's stages; name "
                                   "parts of the submodules' qualified names (e.g. 'mlp', 'self_attention')")
            for sub in matched:
                sub.register_forward_pre_hook(self._enter_op)
                sub.register_forward_hook(self._leave_op)
        cuda = device.type == "cuda"
        self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None
        self.begin_step()

    def begin_step(self) -> None:
        self.saved = SavedBytes()
        self._held: dict[Key, list[weakref.ref]] = defaultdict(list)

    # -- hooks --------------------------------------------------------------------------------------
    @contextmanager
    def forward(self, chunk: int, microbatch: int) -> Iterator[None]:
        """Run a chunk's forward under this: what autograd saves is filed under (chunk, microbatch)."""
        held = self._held[(chunk, microbatch)]
        # weak: autograd keeps the pack hook as long as any saved tensor of the graph lives, and a holder
        # must go when its own saved variable does
        seen: weakref.WeakValueDictionary[tuple, _Saved] = weakref.WeakValueDictionary()
        before = self.saved.now

        def pack(tensor: torch.Tensor):
            if tensor.untyped_storage().data_ptr() in self._parameters or tensor.device != self.device:
                return tensor
            same = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
            if (saved := seen.get(same)) is None:  # one tensor saved by several ops is held once
                saved = seen[same] = _Saved(tensor, not self.ops or self._in_chosen_op > 0, self.saved)
                held.append(weakref.ref(saved))
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        if chunk not in self.saved.per_forward:  # the chunk's first forward: every microbatch has one shape
            self.saved.per_forward[chunk] = self.saved.now - before
            self.saved.movable_per_forward[chunk] = sum(
                saved.nbytes for ref in held if (saved := ref()) is not None and saved.movable)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.device_tensor is None:
            raise OffloadError("a backward needs activations that are on the host: the table must RELOAD them before "
                               "it (primuspipe validate checks this)")
        if saved.event is not None:
            torch.cuda.current_stream(self.device).wait_event(saved.event)
            saved.event = None
        return saved.device_tensor

    def _enter_op(self, *_):
        self._in_chosen_op += 1

    def _leave_op(self, *_):
        self._in_chosen_op -= 1

    # -- the moves ----------------------------------------------------------------------------------
    def handlers(self) -> dict[NodeKind, Handler]:
        """The OFFLOAD and RELOAD handlers a binder adds to its map (the kind table names no binder method
        for them: a binder runs them only with an offload plan)."""
        return {NodeKind.OFFLOAD: lambda call: self.offload(call.chunk, call.microbatch),
                NodeKind.RELOAD: lambda call: self.reload(call.chunk, call.microbatch)}

    def offload(self, chunk: int, microbatch: int) -> None:
        """OFFLOAD: the (chunk, microbatch)'s saved activations to host memory; the device copies go."""
        live = self._live(chunk, microbatch)
        if self._streams is not None and live:  # once: the loop queues nothing on the compute stream
            to_host = self._streams[0]
            to_host.wait_stream(torch.cuda.current_stream(self.device))
        for saved in live:
            tensor = saved.device_tensor
            if self._streams is None:
                saved.host = torch.empty_like(tensor).copy_(tensor)
            else:
                with torch.cuda.stream(to_host):
                    saved.host = torch.empty_like(tensor, device="cpu", pin_memory=True)
                    saved.host.copy_(tensor, non_blocking=True)
                    tensor.record_stream(to_host)  # the block is reused only after the copy
                    saved.event = to_host.record_event()
            saved.device_tensor = None
            self.saved.now -= saved.nbytes

    def reload(self, chunk: int, microbatch: int) -> None:
        """RELOAD: the (chunk, microbatch)'s offloaded activations back to the device."""
        for saved in self._live(chunk, microbatch, on_host=True):
            host = saved.host
            device = torch.empty_like(host, device=self.device)
            if self._streams is None:
                device.copy_(host)
            else:
                to_device = self._streams[1]
                if saved.event is not None:
                    to_device.wait_event(saved.event)  # after the offload's copy
                with torch.cuda.stream(to_device):
                    device.copy_(host, non_blocking=True)
                    saved.event = to_device.record_event()
                device.record_stream(to_device)
            saved.device_tensor, saved.host = device, None
            self.saved.add(saved.nbytes)

    def _live(self, chunk: int, microbatch: int, on_host: bool = False) -> list[_Saved]:
        held = [s for ref in self._held.get((chunk, microbatch), ()) if (s := ref()) is not None and s.movable]
        return [s for s in held if (s.host is not None) == on_host]
