"""Per-stage resource work around a rank's row: where parameters are unsharded, resharded and reduced.

torch.distributed.pipelining lowers a compute order with three actions that move no pipeline data and
change nothing the table computes, so they are not nodes of a table:

* ``UNSHARD s`` / ``RESHARD s``: all-gather / free stage ``s``'s FSDP-sharded parameters. Policy (the
  one torch's lowering applies): before each compute node, the next :data:`MAX_ACTIVE_STAGES` distinct
  stages the rank computes (this node's included) are kept unsharded -- active stages not among them
  are resharded first, then those not yet active are unsharded, in order of use; every stage still
  active is resharded after the row. With two chunks per rank both are unsharded before the first
  node, and each is resharded once the rest of the row no longer computes it.
* ``REDUCE_GRAD s``: after the node that completes stage ``s``'s last weight gradient (the m-th ``W`` or
  ``BW`` part): the end-of-step gradient work -- reduction across data-parallel replicas and, in torch
  2.13, the division of the gradients by the microbatch count (``scale_grads``).

Two consumers read the same plan: the CSV writer (:mod:`primuspipe.io.formats`), so torch's runtime
runs a primuspipe CSV with the resource actions its own schedules get, and the plain-torch backend
(:mod:`primuspipe.backends.torch`), which does that work at the same places.

>>> from primuspipe.ir.node import BW, F
>>> from primuspipe.ir.placement import Placement
>>> row = [F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)]             # stage 0 is chunk 0, stage 1 chunk 1
>>> plan = resource_plan(ScheduleTable.build(Placement.vshape(1), 1, [row]), rank=0)
>>> [[str(a) for a in actions] for actions in (plan.before[0], plan.after[2], plan.before[3], plan.at_end)]
[['0UNSHARD', '1UNSHARD'], ['1REDUCE_GRAD'], ['1RESHARD'], ['0RESHARD']]
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from primuspipe.ir.table import ScheduleTable

MAX_ACTIVE_STAGES = 3
"""Stages a rank keeps unsharded at once (torch's ``_add_unshard_reshard`` default)."""


class Resource(Enum):
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"


@dataclass(frozen=True)
class ResourceAction:
    """One resource action on one stage; prints as torch's CSV cell (``3UNSHARD``)."""

    resource: Resource
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.resource.value}"


@dataclass(frozen=True)
class ResourcePlan:
    """A rank's resource actions, placed around the nodes of its row (indices into the row)."""

    before: dict[int, tuple[ResourceAction, ...]] = field(default_factory=dict)
    """Node index -> actions to run right before that (compute) node."""
    after: dict[int, tuple[ResourceAction, ...]] = field(default_factory=dict)
    """Node index -> actions to run right after that (compute) node."""
    at_end: tuple[ResourceAction, ...] = ()
    """Actions after the whole row."""


@functools.lru_cache(maxsize=64)
def resource_plan(table: ScheduleTable, rank: int, max_active: int = MAX_ACTIVE_STAGES) -> ResourcePlan:
    """Where ``rank`` unshards, reshards and reduces each of its stages (see the module docstring);
    derived once per (immutable) table and rank."""
    row = table.ranks[rank]
    placement = table.placement
    compute = [(i, [placement.stage(rank, chunk) for _, _, chunk in node.parts()])
               for i, node in enumerate(row) if node.kind.is_compute]
    before: dict[int, tuple[ResourceAction, ...]] = {}
    after: dict[int, tuple[ResourceAction, ...]] = {}
    active: list[int] = []
    weight_grads: Counter[int] = Counter()
    remaining = _distinct_after(compute)
    for k, (i, stages) in enumerate(compute):
        upcoming = _next_stages(compute, k, min(max_active, remaining[k]))
        evict = sorted(s for s in active if s not in upcoming)
        fetch = [s for s in upcoming if s not in active]
        active = [s for s in active if s not in evict] + fetch
        actions = [ResourceAction(Resource.RESHARD, s) for s in evict] + [ResourceAction(Resource.UNSHARD, s) for s in fetch]
        if actions:
            before[i] = tuple(actions)
        reduced = []
        for kind, _, chunk in row[i].parts():
            if kind.is_weight_grad:
                stage = placement.stage(rank, chunk)
                weight_grads[stage] += 1
                if weight_grads[stage] == table.microbatches:
                    reduced.append(ResourceAction(Resource.REDUCE_GRAD, stage))
        if reduced:
            after[i] = tuple(reduced)
    return ResourcePlan(before, after, tuple(ResourceAction(Resource.RESHARD, s) for s in active))


def _next_stages(compute: list[tuple[int, list[int]]], start: int, count: int) -> list[int]:
    """The first ``count`` distinct stages of the compute nodes from ``start`` on (all parts of the node
    that reaches the count), in order of use. ``count`` is at most the number of distinct stages left
    (:func:`_distinct_after`), so the scan stops as soon as it has them rather than running to the end
    of the row: a row's plan is linear in its length, not quadratic."""
    seen: list[int] = []
    for _, stages in itertools.islice(compute, start, None):
        seen += [s for s in stages if s not in seen]
        if len(seen) >= count:
            break
    return seen


def _distinct_after(compute: list[tuple[int, list[int]]]) -> list[int]:
    """Per position, how many distinct stages the compute nodes from there to the row's end use."""
    seen: set[int] = set()
    counts = []
    for _, stages in reversed(compute):
        seen.update(stages)
        counts.append(len(seen))
    return counts[::-1]
