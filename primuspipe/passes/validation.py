"""The validator: proves a table safe to run before any process starts.

Rules, in order: structure, offload (every RELOAD follows its OFFLOAD and precedes the backward that
consumes it), completeness, order, pairing, deadlock, memory.

Each rule is a small function that raises :class:`ValidationError` naming the rule, the offending
nodes (marked in the printed grid) and what would fix it. :func:`validate` runs them in order, so a
later rule may rely on the earlier ones (e.g. the deadlock replay trusts that sends and receives pair up).

The deadlock replay models a transport's communication semantics, given as data
(:mod:`primuspipe.passes.streams`: gloo, NCCL's per-pair and per-group streams, batched groups, and
primuspipe's own transport, the default; docs/design.md §3): when an operation runs, what it blocks,
what a compute node waits for. A table hangs exactly when some rank waits, through a chain of
operations and streams, on itself; the replay finds that chain and names it.

**The proof is cached per table.** A table is an immutable value, so once :func:`validate` accepts
one, :func:`is_proven` says so in O(1) for as long as that table object lives; the runner validates
any table it has not seen proven (whoever built it) and pays nothing for the ones
``build_schedule`` and the backends already validated.
"""

from __future__ import annotations

import weakref
from collections import defaultdict, deque

from primuspipe.errors import TableFormatError, ValidationError
from primuspipe import strict
from primuspipe.ir.activations import OFFLOAD_FRACTION, W_RETAINED_FRACTION, running_levels
from primuspipe.ir.dataflow import (
    Transfer,
    inbound,
    required_routes,
    required_transfers,
    step_needs,
    transfer_of,
)
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.streams import DEFAULT_SEMANTICS, replay, semantics_named


_proven: weakref.WeakValueDictionary[tuple[int, bool, str], ScheduleTable] = weakref.WeakValueDictionary()
"""``(id(table), complete, semantics) -> table`` for every table object a validation accepted, with or
without the completeness rule, under a transport's semantics (dropped with the table)."""

_structured: weakref.WeakValueDictionary[int, ScheduleTable] = weakref.WeakValueDictionary()
"""``id(table) -> table`` for every table object :func:`check_structure` accepted: building checks an algorithm's
table, then the communication pass relies on it, so a table (immutable) is walked once."""


@strict.arguments(error=TableFormatError)
def validate(table: ScheduleTable, *, max_in_flight: float | None = None, retained: float = W_RETAINED_FRACTION,
             offloaded: float = OFFLOAD_FRACTION, complete: bool = True,
             semantics: str = DEFAULT_SEMANTICS) -> ScheduleTable:
    """Run every rule (once per table object: see the module docstring); return the table unchanged
    so calls chain.

    ``max_in_flight`` bounds, per rank, the activations held at once, in microbatches of one 1F1B stage
    (a chunk's activation counts ``1/vpp``), each from its F until its W, at ``retained`` of its size
    between B and W (docs/design.md §4), and without the share ``offloaded`` of it between an OFFLOAD
    and its RELOAD. ``complete=False`` leaves out completeness (and the offload pairing, which needs the
    backward), for views that run part of each microbatch's steps (the forward-only view); such a proof
    does not stand for a full one. ``semantics`` names the transport the deadlock replay models
    (:data:`~primuspipe.passes.streams.SEMANTICS`; by default primuspipe's own, what the runner runs).
    """
    semantics_named(semantics)
    retained, offloaded = (strict.number(share, f"validate's {name}", minimum=0, maximum=1, error=TableFormatError)
                           for name, share in (("retained", retained), ("offloaded", offloaded)))
    if not is_proven(table, complete=complete, semantics=semantics):
        check_steps(table, complete=complete)
        if table.has_communication:
            check_pairing(table)
        check_deadlock(table, semantics)
        _proven[id(table), complete, semantics] = table
    if max_in_flight is not None:
        check_in_flight(table, strict.number(max_in_flight, "max_in_flight", minimum=0),
                        strict.number(retained, "retained", minimum=0, maximum=1),
                        strict.number(offloaded, "offloaded", minimum=0, maximum=1))
    return table


def check_steps(table: ScheduleTable, *, complete: bool = True) -> None:
    """The rules on the steps each rank runs, in :func:`validate`'s order: structure, offload and completeness
    (with ``complete``), order. What a timing of the table relies on: the simulator finds unmatched and circular
    transfers itself, but would time a W before its B, or a microbatch that never runs its backward, as given."""
    check_structure(table)
    if complete:
        check_offload(table)
        check_completeness(table)
    check_order(table)


def is_proven(table: ScheduleTable, *, complete: bool = True, semantics: str = DEFAULT_SEMANTICS) -> bool:
    """True when :func:`validate` accepted this very table object under ``semantics`` (with
    completeness, unless ``complete=False`` asks whether it was proven at least without it): it is safe
    to run on that transport."""
    return isinstance(table, ScheduleTable) and (_proven.get((id(table), True, semantics)) is table
                                                 or (not complete and _proven.get((id(table), False, semantics)) is table))


def _fail(table: ScheduleTable, rule: str, what: str, nodes: list[tuple[int, int]], fix: str) -> None:
    raise ValidationError(rule, f"{what}\n{table.grid(marks=nodes)}\nfix: {fix}", tuple(nodes))


def _at(table: ScheduleTable, rank: int, index: int) -> str:
    return f"rank {rank} node {index} ({table.ranks[rank][index]})"


def check_structure(table: ScheduleTable) -> None:
    """Every node refers to an existing chunk and microbatch; communication nodes name the right peer."""
    if _structured.get(id(table)) is table:
        return
    placement, vpp, m = table.placement, table.vpp, table.microbatches
    for rank, row in enumerate(table.ranks):
        checked: set[tuple] = set()  # (kind, chunk, peer) of communication nodes already found right
        for i, node in enumerate(row):
            pair = node.pair
            if node.chunk >= vpp or node.microbatch >= m or (pair is not None and (pair[1] >= vpp or pair[0] >= m)):
                _refuse_part(table, rank, i, node)
            if node.kind.is_compute or (shape := (node.kind, node.chunk, node.peer)) in checked:
                continue
            _check_peer(table, placement, rank, i, node)
            checked.add(shape)
    _structured[id(table)] = table


def _refuse_part(table: ScheduleTable, rank: int, i: int, node) -> None:
    for _, mb, chunk in node.parts() or ((node.kind, node.microbatch, node.chunk),):
        if chunk >= table.vpp or mb >= table.microbatches:
            _fail(table, "structure", f"{_at(table, rank, i)} refers to chunk {chunk} / microbatch {mb}, "
                  f"but the table has vpp={table.vpp} and {table.microbatches} microbatches",
                  [(rank, i)], "drop the node or build the table with the right shape")


def _check_peer(table: ScheduleTable, placement, rank: int, i: int, node) -> None:
    """A communication node moves data between existing stages of two ranks, and names the right peer
    (what is checked does not depend on the microbatch)."""
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


def check_offload(table: ScheduleTable) -> None:
    """Per rank and (chunk, microbatch): at most one OFFLOAD and one RELOAD, both or neither; the
    OFFLOAD after the F and before the backward, the RELOAD after the OFFLOAD and before the backward
    (B or BW), which needs the activations back on the device (docs/offload.md). The kinds come from
    their table entries: the copies by their effect on held activations (out, back), the forward as
    the kind that takes them and the backwards as the kinds that release them."""
    out, back, forward, backward = _offload_roles()
    for rank, row in enumerate(table.ranks):
        if not any(node.kind.on_host_stream for node in row):
            continue  # no copy on this rank: nothing to relate (and a large table's rows indexed for nothing)
        where: dict[tuple[NodeKind, int, int], list[int]] = defaultdict(list)
        for i, node in enumerate(row):
            for kind, mb, chunk in node.parts():
                where[(kind, chunk, mb)].append(i)
        copied = {(c, mb) for k, c, mb in where if k.on_host_stream}
        for chunk, mb in sorted(copied):
            offloads, reloads = where.get((out, chunk, mb), []), where.get((back, chunk, mb), [])
            forwards = where.get((forward, chunk, mb), [])
            backwards = sorted(i for kind in backward for i in where.get((kind, chunk, mb), []))
            name = f"{mb}.{chunk}"
            for kind, seen in ((out, offloads), (back, reloads)):
                if len(seen) > 1:
                    _fail(table, "offload", f"{_at(table, rank, seen[1])} is the second {kind} of microbatch {mb} on "
                          f"chunk {chunk} (the first is node {seen[0]})", [(rank, i) for i in seen],
                          f"keep one OFFLOAD{name} and one RELOAD{name}")
            if not offloads:
                _fail(table, "offload", f"{_at(table, rank, reloads[0])} reloads activations no OFFLOAD{name} moved to host",
                      [(rank, reloads[0])], f"remove RELOAD{name} or put OFFLOAD{name} after F{name}")
            off = offloads[0]
            if not reloads:
                _fail(table, "offload", f"{_at(table, rank, off)} is never reloaded, so the backward of microbatch {mb} "
                      f"on chunk {chunk} would find no activations", [(rank, off)],
                      f"add RELOAD{name} before the backward of {name}, or remove OFFLOAD{name}")
            reload = reloads[0]
            if not forwards or forwards[0] > off:
                _fail(table, "offload", f"{_at(table, rank, off)} offloads before F{name} has made the activations",
                      [(rank, off)] + [(rank, i) for i in forwards[:1]], f"move OFFLOAD{name} after F{name}")
            if backwards and backwards[0] < off:
                _fail(table, "offload", f"{_at(table, rank, off)} offloads after its backward "
                      f"{_at(table, rank, backwards[0])} has run", [(rank, backwards[0]), (rank, off)],
                      f"offload between F{name} and its backward, or remove OFFLOAD{name} and RELOAD{name}")
            if reload < off:
                _fail(table, "offload", f"{_at(table, rank, reload)} reloads before {_at(table, rank, off)} offloads",
                      [(rank, reload), (rank, off)], f"move RELOAD{name} after OFFLOAD{name}")
            if backwards and backwards[0] < reload:
                _fail(table, "offload", f"{_at(table, rank, reload)} comes after its consumer "
                      f"{_at(table, rank, backwards[0])}, which needs the activations back on the device",
                      [(rank, backwards[0]), (rank, reload)], f"move RELOAD{name} before node {backwards[0]}")


def _offload_roles() -> tuple[NodeKind, NodeKind, NodeKind, tuple[NodeKind, ...]]:
    """The kinds :func:`check_offload` relates: (OFFLOAD, RELOAD, F, (B, BW))."""
    kinds = [k for k in compute_kinds() if not k.spec.parts]
    (offload,), (reload,) = ([k for k in kinds if sign * k.spec.offload > 0] for sign in (-1, 1))
    (forward,) = [k for k in kinds if k.spec.activation[0] > 0]
    return offload, reload, forward, tuple(k for k in kinds if k.spec.activation[0] < 0)


def check_completeness(table: ScheduleTable) -> None:
    """Each (stage, microbatch) completes every required step (F, B, W) exactly once -- one F and either
    one BW or one B and one W -- and an optional step at most once; each needed transfer has one send
    and one receive."""
    kinds = [k for k in compute_kinds() if not k.spec.parts]
    required = {step for k in kinds if not k.spec.optional for step in k.completes}
    steps = list(dict.fromkeys(step for k in kinds for step in k.completes))
    done = _step_counts(table, steps)
    m = table.microbatches
    if any(counts.count(1) != len(counts) if step in required else max(counts, default=0) > 1
           for step, counts in zip(steps, done)):
        for stage in range(table.num_stages):
            for mb in range(m):
                cell = stage * m + mb
                if any(counts[cell] != 1 and (step in required or counts[cell] > 1) for step, counts in zip(steps, done)):
                    _refuse_cell(table, kinds, required, stage, mb)
    if table.has_communication:
        _check_transfers_complete(table)


def _step_counts(table: ScheduleTable, steps: list[NodeKind]) -> list[list[int]]:
    """Per step (in ``steps`` order), how many nodes complete it for each ``stage * microbatches + mb``."""
    placement, m = table.placement, table.microbatches
    index = {step: i for i, step in enumerate(steps)}
    counts = [[0] * (table.num_stages * m) for _ in steps]
    for rank, row in enumerate(table.ranks):
        completes: dict[tuple[NodeKind, int], tuple] = {}  # (kind, chunk) -> (step counters, first cell)
        for node in row:
            for kind, mb, chunk in ((node.kind, node.microbatch, node.chunk),) if node.pair is None else node.parts():
                if (known := completes.get((kind, chunk))) is None:
                    stage = placement.stage(rank, chunk)
                    known = completes[(kind, chunk)] = (
                        tuple(counts[index[step]] for step in kind.completes), stage * m)
                for counter in known[0]:
                    counter[known[1] + mb] += 1
    return counts


def _refuse_cell(table: ScheduleTable, kinds: list[NodeKind], required: set[NodeKind], stage: int, mb: int) -> None:
    """The completeness refusal for one (stage, microbatch) the counts found wrong, naming its nodes."""
    placement = table.placement
    ran: dict[NodeKind, list[tuple[int, int]]] = {k: [] for k in kinds}
    for rank, i, node in table.positions():
        for kind, part_mb, chunk in node.parts():
            if part_mb == mb and placement.stage(rank, chunk) == stage:
                ran[kind].append((rank, i))
    done = {step: sum(len(ran[k]) for k in kinds if step in k.completes) for k in kinds for step in k.completes}
    wrong = [step for step, n in done.items() if n != 1 and (step in required or n > 1)]
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


def _check_transfers_complete(table: ScheduleTable) -> None:
    wiring, m = table.wiring, table.microbatches
    size = len(wiring.routes) * m
    sent, received = bytearray(size), bytearray(size)  # counts, saturating at 2 ("more than one")
    for r, moves in enumerate(wiring.moves):
        for node, key in zip(table.ranks[r], moves):
            if key >= 0:
                seen = sent if node.kind.is_send else received
                seen[key] = min(seen[key] + 1, 2)
    required = [wiring.key(Transfer(*route, 0)) for route in required_routes(table.placement)]
    named = {key - key % m for key in range(size) if sent[key] or received[key]}  # routes some node moves
    if None not in required and named == set(required) and all(
            sent[key:key + m].count(1) == m and received[key:key + m].count(1) == m for key in required):
        return
    _refuse_transfers(table)


def _refuse_transfers(table: ScheduleTable) -> None:
    """The first transfer (in transfer order) whose send or receive count is not one."""
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
    raise AssertionError("the transfer counts disagree with the transfers found")


def check_order(table: ScheduleTable) -> None:
    """Within each rank, a node comes after everything it needs that this rank provides: local
    producers, its own receives, and (for sends) the compute that produced the tensor."""
    placement, m, comm = table.placement, table.microbatches, table.has_communication
    steps = {step: i for i, step in enumerate(dict.fromkeys(s for k in compute_kinds() for s in k.completes))}

    def step_key(step: NodeKind, stage: int) -> int:
        """A step as an int, less its microbatch: ``(step * stages + stage) * microbatches``."""
        return (steps[step] * table.num_stages + stage) * m

    wiring = table.wiring
    produced_by = [step_key(route.carries, route.src_stage) for route in wiring.routes]  # what a send needs done
    for rank, row in enumerate(table.ranks):
        done: set[int] = set()
        received: set[int] = set()
        shapes: dict[tuple, tuple] = {}  # (kind, chunk) -> what its parts need and complete, less the microbatch
        for i, (node, moved) in enumerate(zip(row, wiring.moves[rank])):
            kind = node.kind
            if kind.is_recv:
                received.add(moved)
                continue
            if kind.is_send:
                if produced_by[moved // m] + moved % m not in done:
                    _fail(table, "order", f"{_at(table, rank, i)} sends a tensor before {wiring.transfer(moved).carries}{node.microbatch}.{node.chunk} computes it",
                          [(rank, i)], "place the send after its producer")
                continue
            parts = ((kind, node.microbatch, node.chunk),) if node.pair is None else node.parts()
            for part_kind, mb, chunk in parts:
                if (shape := shapes.get((part_kind, chunk))) is None:
                    stage = placement.stage(rank, chunk)
                    local = tuple((need, step_key(need.kind, need.stage)) for need in step_needs(placement, part_kind, stage, 0)
                                  if placement.rank_of(need.stage) == rank)
                    t = inbound(placement, rank, part_kind, chunk, 0)
                    shape = shapes[(part_kind, chunk)] = (
                        local, -1 if t is None or not comm else wiring.key(t),
                        tuple(step_key(done_step, stage) for done_step in part_kind.completes))
                local, first_in, _ = shape
                for need, key in local:
                    if key + mb not in done:
                        _fail(table, "order", f"{_at(table, rank, i)} runs before {need._replace(microbatch=mb)}, which it needs and which this rank computes later or never",
                              [(rank, i)], "move the node after its producer")
                if first_in >= 0 and first_in + mb not in received:
                    _fail(table, "order", f"{_at(table, rank, i)} needs the {wiring.transfer(first_in + mb)} but no receive for it is posted before it",
                          [(rank, i)], "post the receive before its consumer")
            for part_kind, mb, chunk in parts:
                for key in shapes[(part_kind, chunk)][2]:
                    done.add(key + mb)


def check_pairing(table: ScheduleTable) -> None:
    """Per direction, the k-th send and the k-th receive carry the same tensor
    (:class:`~primuspipe.ir.dataflow.Pairing`)."""
    pairing, wiring = table.pairing, table.wiring
    if not pairing.swapped:
        return
    send, recv, k = pairing.swapped[0]
    (src, si), (dst, ri) = pairing.where[send], pairing.where[recv]
    st, rt = wiring.transfer(pairing.key[send]), wiring.transfer(pairing.key[recv])
    _fail(table, "pairing",
          f"rank {src}'s send #{k} to rank {dst} is {table.ranks[src][si]} ({st}) but rank {dst}'s receive #{k} "
          f"from rank {src} is {table.ranks[dst][ri]} ({rt}); transports match a pair's messages in posting "
          "order, so the tensors would be swapped",
          [(src, si), (dst, ri)], f"post rank {dst}'s receives from rank {src} in the order rank {src} sends "
          "(add_communication does this)")


def check_deadlock(table: ScheduleTable, semantics: str = DEFAULT_SEMANTICS) -> None:
    """Replay every rank under the transport's ``semantics`` (:mod:`primuspipe.passes.streams`); refuse
    if some ranks can never finish. A compute-only table is replayed with each transfer available as
    soon as its producer ran (the order of the compute alone)."""
    if not table.has_communication:
        _check_compute_order(table)
        return
    hang = replay(table, semantics)
    if hang is not None:
        model = semantics_named(semantics)
        fix = ("run it with primuspipe's transport (--semantics primuspipe: one stream per direction), or post each "
               "pair's operations so both ranks' streams meet in the same order" if model.stream is not None and
               model.name != "primuspipe" else
               "reorder the compute so each rank produces what its peers wait for before it waits itself, "
               "and post receives in the order the peer sends")
        stops = ", ".join(f"rank {r} at {'its row end' if i == len(table.ranks[r]) else table.ranks[r][i]}"
                          for r, i in sorted(hang.stopped.items()))
        _fail(table, "deadlock", f"under the {model.name} transport semantics ({model.summary}) ranks stop for "
              f"good ({stops}); the operations wait on each other in a cycle:\n  " + "\n  ".join(hang.chain),
              list(hang.nodes), fix)


def _check_compute_order(table: ScheduleTable) -> None:
    wiring = table.wiring
    ptr = [0] * table.pp
    available: set[int] = set()
    waiting: dict[int, list[int]] = defaultdict(list)
    blocked_on: dict[int, int] = {}
    ready = deque(range(table.pp))
    while ready:
        rank = ready.popleft()
        row, takes, gives = table.ranks[rank], wiring.takes[rank], wiring.gives[rank]
        i = ptr[rank]
        while i < len(row):
            missing = [key for key in takes[i] if key not in available]
            if missing:
                blocked_on[rank] = missing[0]
                waiting[missing[0]].append(rank)
                break
            for key in gives[i]:
                available.add(key)
                for r in waiting.pop(key, []):
                    blocked_on.pop(r, None)
                    ready.append(r)
            i += 1
        ptr[rank] = i
    if blocked_on:
        _report_deadlock(table, ptr, {r: wiring.transfer(key) for r, key in blocked_on.items()})


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


def check_in_flight(table: ScheduleTable, limit: float, retained: float = W_RETAINED_FRACTION,
                    offloaded: float = OFFLOAD_FRACTION) -> None:
    """No rank holds more than ``limit`` microbatches of activations (1F1B-stage units) at once."""
    for rank, row in enumerate(table.ranks):
        for i, held in enumerate(running_levels(row, retained=retained, offloaded=offloaded)):
            if held > limit * table.vpp + 1e-9:
                _fail(table, "memory", f"{_at(table, rank, i)} raises the activations held on rank {rank} to "
                      f"{held / table.vpp:g} microbatches, over the limit of {limit:g}",
                      [(rank, i)], "run backwards and weight-gradient (W) nodes earlier, or raise the limit")
