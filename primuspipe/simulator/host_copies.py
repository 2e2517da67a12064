"""Host copies in the simulator: OFFLOAD and RELOAD nodes on each rank's copy streams.

A host-stream node (:attr:`~primuspipe.ir.kinds.KindSpec.stream` ``"host"``) is issued when its rank's
compute stream reaches it in table order -- after the node before it has finished -- and takes no
compute time. Its copy runs on the rank's stream of its direction (device-to-host for OFFLOAD,
host-to-device for RELOAD: a PCIe link copies both ways at once), one copy after another, each taking
``CostModel.copy_time`` (``host_link`` latency plus the moved bytes over its bandwidth). The backward
that consumes a reload (the B or BW part of the same chunk and microbatch) starts only once the reload
copy has finished. Memory follows the copies (:mod:`primuspipe.simulator.memory`): an offload frees
the device when its copy ends, a reload takes the device when its copy starts.

Reloads are completion events like transfers: :func:`reload_keys` gives each (chunk, microbatch) a
key outside the transfers' (negative), which the event loop's arrival map holds.
"""

from __future__ import annotations

from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.table import ScheduleTable


def reload_key(rank: int, chunk: int, microbatch: int, table: ScheduleTable) -> int:
    """The arrival key of the reload of (chunk, microbatch) on ``rank``: negative, so it never meets a
    transfer key."""
    return -1 - ((rank * table.vpp + chunk) * table.microbatches + microbatch)


def reloaded(table: ScheduleTable, rank: int) -> frozenset[tuple[int, int]]:
    """``(chunk, microbatch)`` that ``rank`` reloads."""
    return frozenset((n.chunk, n.microbatch) for n in table.ranks[rank] if n.kind is NodeKind.RELOAD)


def waits_for_reload(table: ScheduleTable, rank: int, node, reloads: frozenset[tuple[int, int]]) -> tuple[int, ...]:
    """The reload keys a compute node waits for: its backward parts' whose activations were offloaded."""
    return tuple(reload_key(rank, chunk, mb, table) for kind, mb, chunk in node.parts()
                 if NodeKind.B in kind.completes and (chunk, mb) in reloads)


def copy_stream(kind: NodeKind) -> int:
    """Which of a rank's two copy streams the kind uses: 0 device-to-host (frees), 1 host-to-device."""
    return 0 if kind.spec.offload < 0 else 1


def describe_key(key: int, table: ScheduleTable) -> str:
    """A reload key in words (for the simulator's 'cannot complete' message)."""
    index = -1 - key
    rank_chunk, mb = divmod(index, table.microbatches)
    rank, chunk = divmod(rank_chunk, table.vpp)
    return f"RELOAD{mb}.{chunk} on rank {rank}, which the table places after its consumer"
