"""The validator: proves a table safe to run before any process starts.

Each rule is a small function that raises :class:`ValidationError` naming the rule, the offending
nodes (marked in the printed grid) and what would fix it. :func:`validate` runs them in order, so a
later rule may rely on the earlier ones (e.g. the deadlock replay trusts that sends and receives pair up).

The deadlock replay models the runner's communication semantics (docs/design.md §3):

* posting a send or a receive never blocks; a send can complete once its receive is posted;
* between two ranks, per direction, the k-th send is matched with the k-th receive (posting order);
* a compute node waits for its own inbound transfers only; everything is completed at step end.

Under these rules a table hangs exactly when some compute node waits, directly or through a chain of
ranks, on a transfer that is posted only after it. The replay finds that chain.

**The proof is cached per table.** A table is an immutable value, so once :func:`validate` accepts
one, :func:`is_proven` says so in O(1) for as long as that table object lives; the runner validates
any table it has not seen proven (whoever built it) and pays nothing for the ones
``build_schedule`` and the backends already validated.
"""

from __future__ import annotations

import weakref
from collections import defaultdict, deque

from primuspipe.errors import ValidationError
from primuspipe.ir import strict
from primuspipe.ir.activations import W_RETAINED_FRACTION, running_levels
from primuspipe.ir.dataflow import (
    Step,
    Transfer,
    inbound,
    outbound,
    required_transfers,
    step_needs,
    steps_done,
    transfer_of,
)
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.table import ScheduleTable


_proven: weakref.WeakValueDictionary[tuple[int, bool], ScheduleTable] = weakref.WeakValueDictionary()
"""``(id(table), complete) -> table`` for every table object a validation accepted, with or without the
completeness rule (dropped with the table)."""


def validate(table: ScheduleTable, *, max_in_flight: float | None = None, retained: float = W_RETAINED_FRACTION,
             complete: bool = True) -> ScheduleTable:
    """Run every rule (once per table object: see the module docstring); return the table unchanged
    so calls chain.

    ``max_in_flight`` bounds, per rank, the activations held at once, in microbatches of one 1F1B stage
    (a chunk's activation counts ``1/vpp``), each from its F until its W, at ``retained`` of its size
    between B and W (docs/design.md §4). ``complete=False`` leaves out completeness, for views that run
    part of each microbatch's steps (the forward-only view); such a proof does not stand for a full one.
    """
    if not is_proven(table, complete=complete):
        check_structure(table)
        if complete:
            check_completeness(table)
        check_order(table)
        if table.has_communication:
            check_pairing(table)
        check_deadlock(table)
        _proven[id(table), complete] = table
    if max_in_flight is not None:
        check_in_flight(table, strict.number(max_in_flight, "max_in_flight", minimum=0),
                        strict.number(retained, "retained", minimum=0, maximum=1))
    return table


def is_proven(table: ScheduleTable, *, complete: bool = True) -> bool:
    """True when :func:`validate` accepted this very table object (with completeness, unless
    ``complete=False`` asks whether it was proven at least without it): it is safe to run."""
    return _proven.get((id(table), True)) is table or (not complete and _proven.get((id(table), False)) is table)


def _fail(table: ScheduleTable, rule: str, what: str, nodes: list[tuple[int, int]], fix: str) -> None:
    raise ValidationError(rule, f"{what}\n{table.grid(marks=nodes)}\nfix: {fix}", tuple(nodes))


def _at(table: ScheduleTable, rank: int, index: int) -> str:
    return f"rank {rank} node {index} ({table.ranks[rank][index]})"


def check_structure(table: ScheduleTable) -> None:
    """Every node refers to an existing chunk and microbatch; communication nodes name the right peer."""
    placement = table.placement
    for rank, i, node in table.positions():
        for _, mb, chunk in node.parts() or ((node.kind, node.microbatch, node.chunk),):
            if chunk >= table.vpp or mb >= table.microbatches:
                _fail(table, "structure", f"{_at(table, rank, i)} refers to chunk {chunk} / microbatch {mb}, "
                      f"but the table has vpp={table.vpp} and {table.microbatches} microbatches",
                      [(rank, i)], "drop the node or build the table with the right shape")
        if node.kind.is_compute:
            continue
        t = transfer_of(placement, rank, node)
        if not (0 <= t.src_stage < table.num_stages and 0 <= t.dst_stage < table.num_stages):
            _fail(table, "structure", f"{_at(table, rank, i)} moves data past the first or last stage",
                  [(rank, i)], "remove the node")
        other = t.dst_stage if node.kind.is_send else t.src_stage
        want = placement.rank_of(other)
        if want == rank:
            _fail(table, "structure", f"{_at(table, rank, i)} communicates a hand-off that stays on rank {rank}",
                  [(rank, i)], "remove it: chunks on one rank pass tensors locally")
        if node.peer != want:
            _fail(table, "structure", f"{_at(table, rank, i)} names peer {node.peer}, but stage {other} lives on rank {want}",
                  [(rank, i)], f"use peer {want}")


def check_completeness(table: ScheduleTable) -> None:
    """Each (stage, microbatch) completes every required step (F, B, W) exactly once -- one F and either
    one BW or one B and one W -- and an optional step at most once; each needed transfer has one send
    and one receive."""
    placement = table.placement
    seen: dict[tuple[NodeKind, int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, i, node in table.positions():
        for kind, mb, chunk in node.parts():
            seen[(kind, placement.stage(rank, chunk), mb)].append((rank, i))
    kinds = [k for k in compute_kinds() if not k.spec.parts]
    required = {step for k in kinds if not k.spec.optional for step in k.completes}
    doers = {step: [k for k in kinds if step in k.completes] for k in kinds for step in k.completes}
    for stage in range(table.num_stages):
        for mb in range(table.microbatches):
            done = {step: sum(len(seen.get((k, stage, mb), ())) for k in ks) for step, ks in doers.items()}
            wrong = [step for step, n in done.items() if n != 1 and (step in required or n > 1)]
            if not wrong:
                continue
            ran = {k: seen.get((k, stage, mb), []) for k in kinds}
            problems = [f"{len(ran[NodeKind.F])} forwards"] if NodeKind.F in wrong else []
            others = sorted((k for k in kinds if k is not NodeKind.F and any(s in wrong for s in k.completes)),
                            key=lambda k: -len(k.completes))
            if others:
                counts = [f"{len(ran[k])} {k}" for k in others]
                problems.append(", ".join(counts[:-1]) + f" and {counts[-1]}" if len(counts) > 1 else counts[0])
            marks = [pos for k in kinds if any(s in wrong for s in k.completes) for pos in ran[k]]
            rank, chunk = placement.locate(stage)
            _fail(table, "completeness",
                  f"stage {stage} (rank {rank}, chunk {chunk}), microbatch {mb} has {' and '.join(problems)}; it needs "
                  "exactly one F and either one BW or one B and one W",
                  marks or [pos for k in kinds for pos in ran[k]],
                  f"add or remove nodes on rank {rank} so each microbatch is computed once")
    if table.has_communication:
        _check_transfers_complete(table)


def _check_transfers_complete(table: ScheduleTable) -> None:
    sends: dict[Transfer, list] = defaultdict(list)
    recvs: dict[Transfer, list] = defaultdict(list)
    for rank, i, node in table.positions():
        if not node.kind.is_compute:
            (sends if node.kind.is_send else recvs)[table.transfers[rank][i]].append((rank, i))
    every = required_transfers(table.placement, table.microbatches) | sends.keys() | recvs.keys()
    wrong = [t for t in every if len(sends[t]) != 1 or len(recvs[t]) != 1]
    for t in sorted(wrong):  # sorted only when something is wrong: the first one is reported
        for name, where in (("send", sends[t]), ("receive", recvs[t])):
            if len(where) != 1:
                src, dst = (table.placement.rank_of(t.src_stage), table.placement.rank_of(t.dst_stage))
                _fail(table, "completeness", f"the {t} (rank {src} -> {dst}) has {len(where)} {name} nodes, needs 1",
                      sends[t] + recvs[t], "rebuild communication with add_communication(table.compute_only())")


def check_order(table: ScheduleTable) -> None:
    """Within each rank, a node comes after everything it needs that this rank provides: local
    producers, its own receives, and (for sends) the compute that produced the tensor."""
    placement = table.placement
    for rank, row in enumerate(table.ranks):
        done: set[Step] = set()
        received: set[Transfer] = set()
        for i, node in enumerate(row):
            if node.kind.is_recv:
                received.add(table.transfers[rank][i])
                continue
            if node.kind.is_send:
                t = table.transfers[rank][i]
                if Step(t.carries, t.src_stage, t.microbatch) not in done:
                    _fail(table, "order", f"{_at(table, rank, i)} sends a tensor before {t.carries}{node.microbatch}.{node.chunk} computes it",
                          [(rank, i)], "place the send after its producer")
                continue
            for kind, mb, chunk in node.parts():
                stage = placement.stage(rank, chunk)
                for need in step_needs(placement, kind, stage, mb):
                    if placement.rank_of(need.stage) == rank and need not in done:
                        _fail(table, "order", f"{_at(table, rank, i)} runs before {need}, which it needs and which this rank computes later or never",
                              [(rank, i)], "move the node after its producer")
                t = inbound(placement, rank, kind, chunk, mb)
                if table.has_communication and t is not None and t not in received:
                    _fail(table, "order", f"{_at(table, rank, i)} needs the {t} but no receive for it is posted before it",
                          [(rank, i)], "post the receive before its consumer")
            done.update(steps_done(placement, rank, node))


def check_pairing(table: ScheduleTable) -> None:
    """Per direction, the k-th send and the k-th receive carry the same tensor."""
    lanes: dict[tuple[int, int, bool], list[tuple[int, Transfer]]] = defaultdict(list)
    for rank, i, node in table.positions():
        if not node.kind.is_compute:
            pair = (rank, node.peer) if node.kind.is_send else (node.peer, rank)
            lanes[(*pair, node.kind.is_send)].append((i, table.transfers[rank][i]))
    for (src, dst, is_send), sends in sorted(lanes.items()):
        if not is_send:
            continue
        recvs = lanes.get((src, dst, False), [])
        for k, ((si, st), (ri, rt)) in enumerate(zip(sends, recvs)):
            if st != rt:
                _fail(table, "pairing",
                      f"rank {src}'s send #{k} to rank {dst} is {table.ranks[src][si]} ({st}) but rank {dst}'s receive #{k} "
                      f"from rank {src} is {table.ranks[dst][ri]} ({rt}); transports match a pair's messages in posting "
                      "order, so the tensors would be swapped",
                      [(src, si), (dst, ri)], f"post rank {dst}'s receives from rank {src} in the order rank {src} sends "
                      "(add_communication does this)")


def check_deadlock(table: ScheduleTable) -> None:
    """Replay every rank under the runner's semantics; refuse if some ranks can never finish."""
    placement, comm = table.placement, table.has_communication
    ptr = [0] * table.pp
    available: set[Transfer] = set()
    waiting: dict[Transfer, list[int]] = defaultdict(list)
    blocked_on: dict[int, Transfer] = {}
    ready = deque(range(table.pp))
    while ready:
        rank = ready.popleft()
        row = table.ranks[rank]
        while ptr[rank] < len(row):
            node = row[ptr[rank]]
            produced: list[Transfer] = []
            if node.kind.is_send:
                produced.append(table.transfers[rank][ptr[rank]])
            elif node.kind.is_compute:
                missing = [t for kind, mb, chunk in node.parts()
                           if (t := inbound(placement, rank, kind, chunk, mb)) is not None and t not in available]
                if missing:
                    blocked_on[rank] = missing[0]
                    waiting[missing[0]].append(rank)
                    break
                if not comm:  # compute-only: a transfer is available as soon as its producer ran
                    produced = [t for kind, mb, chunk in node.parts()
                                if (t := outbound(placement, rank, kind, chunk, mb)) is not None]
            for t in produced:
                available.add(t)
                for r in waiting.pop(t, []):
                    blocked_on.pop(r, None)
                    ready.append(r)
            ptr[rank] += 1
    if blocked_on:
        _report_deadlock(table, ptr, blocked_on)


def _report_deadlock(table: ScheduleTable, ptr: list[int], blocked_on: dict[int, Transfer]) -> None:
    placement = table.placement
    chain, rank = [], min(blocked_on)
    while rank in blocked_on and rank not in chain:
        chain.append(rank)
        rank = placement.rank_of(blocked_on[rank].src_stage)
    cycle = chain[chain.index(rank):] if rank in chain else chain
    lines = [f"{_at(table, r, ptr[r])} waits for the {blocked_on[r]} from rank {placement.rank_of(blocked_on[r].src_stage)}"
             for r in cycle]
    _fail(table, "deadlock", "these ranks wait on each other forever:\n  " + "\n  ".join(lines),
          [(r, ptr[r]) for r in sorted(blocked_on)],
          "reorder the compute so each rank produces what its peers wait for before it waits itself, "
          "and post receives in the order the peer sends")


def check_in_flight(table: ScheduleTable, limit: float, retained: float = W_RETAINED_FRACTION) -> None:
    """No rank holds more than ``limit`` microbatches of activations (1F1B-stage units) at once."""
    for rank, row in enumerate(table.ranks):
        for i, held in enumerate(running_levels(row, retained=retained)):
            if held > limit * table.vpp + 1e-9:
                _fail(table, "memory", f"{_at(table, rank, i)} raises the activations held on rank {rank} to "
                      f"{held / table.vpp:g} microbatches, over the limit of {limit:g}",
                      [(rank, i)], "run backwards and weight-gradient (W) nodes earlier, or raise the limit")
