"""Point-to-point transport for the runner: non-blocking sends and receives over per-direction channels.

Semantics are the ones the validator proves deadlock-free (:mod:`primuspipe.passes.streams`, the
``primuspipe`` model): posting never blocks; per direction (this rank -> peer) messages are matched in
posting order, across kinds. On NCCL/RCCL a send or receive blocks its stream until the peer's matching
operation runs, and torch puts every unbatched operation between two ranks of a group on one stream
(or, under eager init, every operation of the group on one): a table whose two ranks post their
operations for the pair in different orders would hang there although it runs on gloo. So every
direction gets a channel of its own (:mod:`primuspipe.runtime.channels`): its stream carries one
direction, in order, which is exactly the per-direction rule the validator proves, under lazy and
eager init alike. Ops are never batched (``batch_isend_irecv`` may reorder them on gloo).

``channels="shared"`` posts every transfer unbatched on the pipeline's own group, as primuspipe did
before per-direction channels: safe on gloo, a hang on NCCL for most tables (kept for comparison and
for the emulator's negative control; ``validate --semantics nccl-pair`` predicts which).

The hang watchdog (:mod:`primuspipe.runtime.watchdog`) gives every transfer a deadline and names the
node, the peer and the ranks to blame when one passes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from primuspipe.errors import ConfigError
from primuspipe.ir.node import ScheduleNode
from primuspipe.runtime.channels import Channels, channels_for
from primuspipe.runtime.protocols import Pending
from primuspipe.runtime.watchdog import watchdog_for

T = TypeVar("T")
"""What a posting returns (the requests, or the opened channels)."""

CHANNEL_MODES = ("direction", "shared")


class P2PTransport:
    """torch.distributed point-to-point for one process group (peers are ranks *in* that group), over
    its per-direction channels (``channels="direction"``, the default) or the group itself (``"shared"``)."""

    def __init__(self, group: Any, *, timeout_s: float, channels: str = "direction"):
        if channels not in CHANNEL_MODES:
            raise ConfigError(f"channels must be one of {', '.join(CHANNEL_MODES)}, got {channels!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout_s = float(timeout_s)
        self._global = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self.channel_mode = channels
        self._channels: Channels | None = None
        self.watchdog = watchdog_for(group, self.timeout_s) if self.timeout_s > 0 else None

    def _opened(self, node: ScheduleNode) -> Channels:
        """The group's channels, opened by the first transfer of the first step (every rank gets there:
        nothing before a rank's first transfer waits); a peer that never arrives is reported as that
        transfer's hang."""
        if self._channels is None:
            opening = timedelta(seconds=self.timeout_s or 600)  # not forever either: the watchdog's, else ten minutes
            self._channels = self._post(node, lambda: channels_for(self.group, opening))
            if self.watchdog is not None:
                self.watchdog.on_abort(self._channels.abort)
        return self._channels

    def isend(self, node: ScheduleNode, tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> Pending:
        # Send an alias, not the tensor itself: a caller may then swap the tensor's storage (Megatron's
        # deallocate_output_tensor) while the transfer still reads the old one, which the alias keeps alive.
        # A tuple of tensors goes as consecutive messages, one request each.
        aliases = tuple(t.detach() for t in tensor) if isinstance(tensor, tuple) else tensor.detach()
        return self._transfer(node, aliases, send=True)

    def irecv(self, node: ScheduleNode, buffer: torch.Tensor | tuple[torch.Tensor, ...]) -> Pending:
        return self._transfer(node, buffer, send=False)

    def _transfer(self, node: ScheduleNode, tensors: Any, send: bool) -> Pending:
        """Post one request per tensor: on the direction's channel (where the peer is rank 1 to a sender,
        rank 0 to a receiver), or on the group itself."""
        self._check()
        if self.channel_mode == "direction":
            channels = self._opened(node)
            channel = channels.to(node.peer) if send else channels.from_(node.peer)
            post = channel.send if send else channel.recv
            works = self._post(node, lambda: [post([t], 1 if send else 0, 0) for t in _each(tensors)])
        else:
            peer, group = self._global[node.peer], self.group
            works = self._post(node, lambda: [dist.isend(t, dst=peer, group=group) if send else
                                              dist.irecv(t, src=peer, group=group) for t in _each(tensors)])
        return self._track(Pending(node, tensors, works))

    def _post(self, node: ScheduleNode, post: Callable[[], T]) -> T:
        """Post the requests (or open the channels); a backend that refuses (gloo, once the peer's connection
        closed; a peer that never arrives) is reported like a failed transfer."""
        try:
            return post()
        except RuntimeError as exc:
            if self.watchdog is None:
                raise
            raise self.watchdog.report(Pending(node, None, []), exc) from exc

    def _check(self) -> None:
        if self.watchdog is not None:
            self.watchdog.raise_if_failed()

    def _track(self, pending: Pending) -> Pending:
        if self.watchdog is not None:
            self.watchdog.track(pending)
        return pending

    def complete(self, pending: Pending) -> None:
        """Complete the request: stream-ordered where the backend allows (never blocks the host), else
        (gloo) waiting at most until the request's deadline."""
        watchdog = self.watchdog
        if watchdog is None:
            for work in pending.work:
                work.wait()
            return
        self._check()
        if watchdog.poll_completion:
            for work in pending.work:
                work.wait()  # the monitor thread sees it complete (or not)
            return
        try:
            deadline = watchdog.deadline(pending)
            for work in pending.work:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as exc:
            raise watchdog.report(pending, exc) from exc
        finally:
            watchdog.untrack(pending)


def _each(tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tensor if isinstance(tensor, tuple) else (tensor,)
