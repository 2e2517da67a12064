"""One two-rank communicator per direction and neighbour pair: the streams every proven table is safe on.

NCCL runs a send or receive as a blocking operation on a stream, and torch keys that stream by the rank
pair (lazy init) or by the group (eager init), so two directions -- or two peers -- posted in different
orders on the two ranks wait on each other (:mod:`primuspipe.passes.streams`). A channel here is a
backend of two ranks, ``[source, destination]``, that carries one direction only: its one stream holds
this rank's sends to the peer, or its receives from it, in posting order -- the per-direction rule the
validator proves -- whether the stream is the pair's or the group's.

The channels of a pipeline are the directions between ring neighbours (rank r to r+1 and back, and
the last rank to the first and back: every table of the interleaved and the V placements moves its
transfers along those). They are built once per process group, in one order every rank shares (sorted
by global source and destination), and each is used once right away: a communicator's creation
blocks the host until its other rank arrives, so creating them in that order -- not at a transfer's
first use, in the table's order -- cannot wait in a cycle. The backend objects are made directly
(gloo, NCCL, or the NCCL emulator; each on a store prefix of its own), without registering process
groups: only the two ranks of a channel take part, and no other rank of the job needs to know.

Cost: two communicators per neighbour pair (four per rank at most; on NCCL each lazily allocates its
point-to-point buffers when first used), and no added waiting: a stream runs only its own direction.
"""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from primuspipe.errors import ConfigError
from primuspipe.runtime import nccl_emulation
from primuspipe.runtime.liveness import attempt, default_store


def ring_directions(size: int) -> list[tuple[int, int]]:
    """The directions (group ranks) between ring neighbours of a pipeline of ``size`` ranks."""
    pairs = {(r, (r + 1) % size) for r in range(size)} | {((r + 1) % size, r) for r in range(size)}
    return sorted(p for p in pairs if p[0] != p[1])


class Channels:
    """A pipeline group's per-direction backends (for this rank: the ones it sends or receives on)."""

    def __init__(self, group: Any, timeout: timedelta):
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
        store = default_store()
        if store is None:
            raise ConfigError("primuspipe's transport needs torch.distributed's default store (init_process_group)")
        name = dist.distributed_c10d._world.pg_names.get(group) or "-".join(map(str, ranks))
        prefix = f"primuspipe/{attempt()}/channels/{name}/"
        device = _device(backend)
        self._by_direction: dict[tuple[int, int], Any] = {}
        order = sorted(ring_directions(len(ranks)), key=lambda d: (ranks[d[0]], ranks[d[1]]))
        for src, dst in order:
            if self.rank in (src, dst):
                sub = dist.PrefixStore(f"{prefix}{ranks[src]}-{ranks[dst]}/", store)
                channel = _backend(backend, sub, 0 if self.rank == src else 1, timeout, device,
                                   name=f"{prefix}{ranks[src]}-{ranks[dst]}", members=[ranks[src], ranks[dst]])
                probe = torch.zeros(1, device=device)
                (channel.send([probe], 1, 0) if self.rank == src else channel.recv([probe], 0, 0)).wait()
                self._by_direction[src, dst] = channel

    def to(self, peer: int) -> Any:
        """The channel this rank sends to ``peer`` on (the destination is its rank 1)."""
        return self._channel((self.rank, peer))

    def from_(self, peer: int) -> Any:
        """The channel this rank receives from ``peer`` on (the source is its rank 0)."""
        return self._channel((peer, self.rank))

    def _channel(self, direction: tuple[int, int]) -> Any:
        try:
            return self._by_direction[direction]
        except KeyError:
            raise ConfigError(f"no channel {direction[0]} -> {direction[1]}: primuspipe's transport connects ring "
                              "neighbours only (the interleaved and V placements); this table sends between other "
                              "ranks, so run it with channels='shared' on gloo") from None

    def release(self) -> None:
        for channel in self._by_direction.values():
            if isinstance(channel, nccl_emulation.EmulatedNCCLGroup):
                channel.shutdown()
        self._by_direction.clear()

    def abort(self) -> None:
        for channel in self._by_direction.values():
            try:
                channel.abort()
            except (RuntimeError, AttributeError):
                pass


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _backend(backend: str, store: Any, rank: int, timeout: timedelta, device: torch.device, *, name: str,
             members: list[int]) -> Any:
    """A two-rank backend of the pipeline group's kind (``name`` and the global ``members`` label it in
    NCCL's own logs and flight recorder)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == nccl_emulation.BACKEND:
        return nccl_emulation.EmulatedNCCLGroup(store, rank, 2, timeout, nccl_emulation.mode() or "pair")
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        options.group_name = name
        options.global_ranks_in_group = members
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ConfigError(f"primuspipe's transport builds per-direction channels on gloo, nccl (RCCL too) and the NCCL "
                      f"emulator; the pipeline group's backend is {backend!r}: use channels='shared'")


_channels: "weakref.WeakKeyDictionary[Any, Channels]" = weakref.WeakKeyDictionary()


@atexit.register
def _release() -> None:
    """Drop the channels' backends while Python still runs (a gloo backend left to the interpreter's
    exit can abort the process, see :meth:`nccl_emulation.EmulatedNCCLGroup.shutdown`)."""
    for channels in list(_channels.values()):
        channels.release()
    _channels.clear()


def channels_for(group: Any, timeout: timedelta) -> Channels:
    """The group's channels, built on first use (by every rank of the group at the same point: SPMD)."""
    found = _channels.get(group)
    if found is None:
        found = _channels[group] = Channels(group, timeout)
    return found
