"""Point-to-point transport for the runner: non-blocking sends and receives with a hang watchdog.

Semantics are the ones the validator proves deadlock-free (see :mod:`primuspipe.passes.validation`):
posting never blocks; per direction (this rank -> peer) messages are matched in posting order, across
kinds. A transfer of several tensors (a tuple, e.g. a stage that passes hidden states and a mask) is
posted as consecutive messages, in tuple order, by both sides, so it keeps that matching. Every message between a pair goes through one channel (one process group, one tag) on purpose:
that is how NCCL/RCCL match point-to-point messages (they ignore tags), so a table that is safe here is
safe there, and the order the table gives is the only thing that keeps an activation apart from a
gradient when both neighbours are the same rank (docs/design.md §3). Ops are never batched
(``batch_isend_irecv`` may reorder them on gloo).

The watchdog turns a transfer that does not complete within ``timeout_s`` into
:class:`~primuspipe.errors.PipelineHangError` naming the rank, node and peer. Completion is awaited
with a deadline: gloo's ``Work.wait(timeout)`` (gloo only marks a request completed inside ``wait``,
so polling ``is_completed`` would spin forever), elsewhere by polling ``is_completed()``.
"""

from __future__ import annotations

import time
from datetime import timedelta
import torch
import torch.distributed as dist

from primuspipe.errors import PipelineHangError
from primuspipe.ir.node import ScheduleNode
from primuspipe.runtime.protocols import Pending

_POLL_SLEEP_S = 50e-6


class P2PTransport:
    """torch.distributed point-to-point over one process group (peers are ranks *in* that group).

    ``timeout_s`` of ``0`` turns the watchdog off: requests are then completed with a plain ``wait()``,
    which on NCCL only orders the compute stream after the transfer and never stalls the CPU.
    """

    def __init__(self, group: Any, *, timeout_s: float):
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout_s = float(timeout_s)
        self._global = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self._wait_with_timeout = dist.get_backend(group) == "gloo"

    def isend(self, node: ScheduleNode, tensor: torch.Tensor | tuple[torch.Tensor, ...]) -> Pending:
        # Send an alias, not the tensor itself: a caller may then swap the tensor's storage (Megatron's
        # deallocate_output_tensor) while the transfer still reads the old one, which the alias keeps alive.
        if isinstance(tensor, tuple):
            aliases = tuple(t.detach() for t in tensor)
            works = [dist.isend(a, dst=self._global[node.peer], group=self.group) for a in aliases]
            return Pending(node, aliases, works)
        alias = tensor.detach()
        return Pending(node, alias, [dist.isend(alias, dst=self._global[node.peer], group=self.group)])

    def irecv(self, node: ScheduleNode, buffer: torch.Tensor | tuple[torch.Tensor, ...]) -> Pending:
        buffers = buffer if isinstance(buffer, tuple) else (buffer,)
        works = [dist.irecv(b, src=self._global[node.peer], group=self.group) for b in buffers]
        return Pending(node, buffer, works)

    def complete(self, pending: Pending) -> None:
        """Wait for the request(s), raising :class:`PipelineHangError` past the watchdog timeout."""
        deadline = time.perf_counter() + self.timeout_s
        for work in pending.work:
            self._wait(pending, work, deadline)

    def _wait(self, pending: Pending, work, deadline: float) -> None:
        if self.timeout_s <= 0:
            work.wait()
            return
        if self._wait_with_timeout:
            try:
                work.wait(timedelta(seconds=max(deadline - time.perf_counter(), 1e-3)))
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                    raise
                raise self._hang(pending, exc) from exc
            return
        while not work.is_completed():
            if time.perf_counter() > deadline:
                raise self._hang(pending, None)
            time.sleep(_POLL_SLEEP_S)
        work.wait()

    def _hang(self, pending: Pending, cause: Exception | None) -> PipelineHangError:
        node = pending.node
        what = "send to" if node.kind.is_send else "receive from"
        detail = f" ({cause})" if cause is not None else ""
        return PipelineHangError(
            f"pipeline rank {self.rank}: {node} ({what} pipeline rank {node.peer}) did not complete within "
            f"{self.timeout_s:g} s{detail}. The peer is stuck, dead or runs a different schedule; raise "
            "watchdog_timeout_s if the peer is merely slow."
        )
