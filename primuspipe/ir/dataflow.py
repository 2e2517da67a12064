"""What each node consumes and produces: the one dependency model shared by every pass and consumer.

Everything here is derived from the kind table (:mod:`primuspipe.ir.kinds`): a compute part of kind K
on stage s completes the steps ``K.completes`` and needs the steps ``(step, s + offset)`` of
``K.needs`` first. A need on another stage is a *hand-off*: local between chunks of one rank,
otherwise a :class:`Transfer` that a SEND/RECV pair moves. The validator, the communication pass, the
simulator, the runner's plan, the list scheduler and the MILP all ask these functions, so a rule is
written once.

Steps are identified by ``Step(kind, stage, microbatch)``: ``Step(NodeKind.B, 3, 0)`` is "the input
gradient of stage 3, microbatch 0 is done" (by a B or a BW node).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from primuspipe.ir.kinds import NodeKind, all_kinds, comm_kind, on_kinds_changed, split_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement


class Step(NamedTuple):
    kind: NodeKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.microbatch})"


class Transfer(NamedTuple):
    """A tensor crossing ranks: the result of step ``carries`` of ``src_stage`` that ``dst_stage``
    needs (``F``: an activation, stage s -> s+1; ``B``: a gradient, s+1 -> s)."""

    carries: NodeKind
    src_stage: int
    dst_stage: int
    microbatch: int

    def __str__(self) -> str:
        what = "activation" if self.carries is NodeKind.F else "gradient"
        return f"{what} of mb {self.microbatch}, stage {self.src_stage} -> {self.dst_stage}"


class Route(NamedTuple):
    """Where a transfer goes, whatever its microbatch: a :class:`Transfer` less its microbatch."""

    carries: NodeKind
    src_stage: int
    dst_stage: int


class Handoff(NamedTuple):
    """A tensor passed between stages as a runner sees it: what it carries, the local chunk that
    consumes (or, for an outgoing one, produces) it, and its microbatch."""

    carries: NodeKind
    chunk: int
    microbatch: int


def steps_done(placement: Placement, rank: int, node: ScheduleNode) -> list[Step]:
    """The steps a compute node completes (an FB node completes an F and a B)."""
    return [Step(done, placement.stage(rank, chunk), mb) for kind, mb, chunk in node.parts() for done in kind.completes]


def step_needs(placement: Placement, kind: NodeKind, stage: int, mb: int) -> list[Step]:
    """Steps that must be done before this compute part may start (anywhere in the pipeline)."""
    return [Step(step, stage + offset, mb) for step, offset in _needs(kind, placement.num_stages, stage)]


@cache
def _needs(kind: NodeKind, num_stages: int, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    """``(step, offset)`` of ``kind``'s needs that exist for ``stage`` (not past either end)."""
    assert kind.is_compute and not kind.spec.parts, f"dependencies are per single compute kind, got {kind}"
    return tuple((NodeKind(step), offset) for step, offset in kind.spec.needs if 0 <= stage + offset < num_stages)


@cache
def consumers(step: NodeKind) -> tuple[tuple[NodeKind, int], ...]:
    """``(kind, offset)`` of the kinds that need ``step`` of the stage ``offset`` away from theirs."""
    return tuple((kind, offset) for kind in all_kinds() if kind.is_compute
                 for need, offset in kind.spec.needs if need == step.name)


def handoffs_in(placement: Placement, kind: NodeKind, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    """``(carries, source stage)`` of what a part of ``kind`` on ``stage`` takes from other stages."""
    return _handoffs_in(kind, placement.num_stages, stage)


def handoffs_out(placement: Placement, kind: NodeKind, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    """``(carries, destination stage)`` of what a part of ``kind`` on ``stage`` hands to other stages."""
    return _handoffs_out(kind, placement.num_stages, stage)


@cache
def _handoffs_in(kind: NodeKind, num_stages: int, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    return tuple((step, stage + offset) for step, offset in _needs(kind, num_stages, stage) if offset)


@cache
def _handoffs_out(kind: NodeKind, num_stages: int, stage: int) -> tuple[tuple[NodeKind, int], ...]:
    out: list[tuple[NodeKind, int]] = []
    for step in kind.completes:
        for dst in sorted({stage - offset for _, offset in consumers(step) if offset}):
            if 0 <= dst < num_stages and (step, dst) not in out:
                out.append((step, dst))
    return tuple(out)


def inbound(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int) -> Transfer | None:
    """The cross-rank transfer a compute part consumes, if its input comes from another rank."""
    return _crossing(placement, rank, kind, chunk, mb, incoming=True)


def outbound(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int) -> Transfer | None:
    """The cross-rank transfer a compute part produces, if its consumer lives on another rank."""
    return _crossing(placement, rank, kind, chunk, mb, incoming=False)


def _crossing(placement: Placement, rank: int, kind: NodeKind, chunk: int, mb: int, incoming: bool) -> Transfer | None:
    stage = placement.stage(rank, chunk)
    handoffs = (handoffs_in if incoming else handoffs_out)(placement, kind, stage)
    found = [Transfer(step, other, stage, mb) if incoming else Transfer(step, stage, other, mb)
             for step, other in handoffs if placement.rank_of(other) != rank]
    assert len(found) <= 1, f"{kind} moves more than one transfer each way"
    return found[0] if found else None


def released_transfer(placement: Placement, kind: NodeKind, stage: int, src_stage: int, mb: int) -> Transfer | None:
    """What a part of ``kind`` on ``stage`` proves delivered when it takes a transfer from ``src_stage``:
    the transfer this stage sent ``src_stage`` in a step the part needs (a gradient coming back from a
    stage means that stage consumed the activation sent to it). The runner completes that send there,
    so the replay waits for it there too."""
    for step, offset in kind.spec.needs:
        if offset == 0:
            for carries, dst in handoffs_out(placement, NodeKind(step), stage):
                if dst == src_stage:
                    return Transfer(carries, stage, dst, mb)
    return None


def required_routes(placement: Placement) -> set[Route]:
    """Every route a complete table of this shape moves a transfer along, once per microbatch."""
    out = set()
    for kind in all_kinds():
        if not kind.is_compute or kind.spec.parts or kind.spec.optional:
            continue
        for stage in range(placement.num_stages):
            for step, src in handoffs_in(placement, kind, stage):
                if placement.rank_of(src) != placement.rank_of(stage):
                    out.add(Route(step, src, stage))
    return out


def required_transfers(placement: Placement, microbatches: int) -> set[Transfer]:
    """Every transfer a complete table of this shape must move."""
    return {Transfer(*route, mb) for route in required_routes(placement) for mb in range(microbatches)}


def transfer_of(placement: Placement, rank: int, node: ScheduleNode) -> Transfer:
    """The transfer a communication node moves, derived from the local chunk it names."""
    stage = placement.stages[rank][node.chunk]
    peer_stage = stage + node.kind.spec.peer_offset
    src, dst = (stage, peer_stage) if node.kind.is_send else (peer_stage, stage)
    return Transfer(node.kind.carries, src, dst, node.microbatch)


def comm_node(placement: Placement, transfer: Transfer, send: bool) -> ScheduleNode:
    """The SEND (on the source rank) or RECV (on the destination rank) node for ``transfer``."""
    local, remote = (transfer.src_stage, transfer.dst_stage) if send else (transfer.dst_stage, transfer.src_stage)
    _, chunk = placement.locate(local)
    return ScheduleNode(comm_kind(send, transfer.carries), transfer.microbatch, chunk, peer=placement.rank_of(remote))


class Wiring:
    """A table's transfers as integers, derived once for passes that visit every node.

    Validating or simulating a table of hundreds of thousands of nodes asks "which transfer does this
    node move, consume or produce?" for every node; the answer depends on the microbatch only through
    the transfer's microbatch, so it is worked out once per (rank, kind, chunk, peer) shape and a
    transfer is named by an int, its *key* ``route * microbatches + microbatch`` (:meth:`transfer`
    turns a key back into a :class:`Transfer`). Per rank and node:

    * ``moves[rank][i]``: the key a SEND/RECV node moves, ``-1`` for a compute node;
    * ``takes[rank][i]``: the keys a compute node consumes from other ranks (one per part that has one);
    * ``gives[rank][i]``: the keys a compute node produces for other ranks.

    Built from :func:`inbound`, :func:`outbound` and :func:`transfer_of`, so it is the dependency
    model, only faster to ask. The table must name existing chunks (``check_structure``).
    """

    __slots__ = ("routes", "microbatches", "moves", "takes", "gives", "_ids")

    def __init__(self, placement: Placement, microbatches: int, ranks) -> None:
        self.microbatches = microbatches
        self.routes: list[Route] = []
        self._ids: dict[Route, int] = {}
        self.moves, self.takes, self.gives = [], [], []
        if placement is not None:
            self._derive(placement, ranks)

    def with_rows(self, moves: list[list[int]], takes: list[list[tuple]], gives: list[list[tuple]]) -> Wiring:
        """The wiring of another table of the same routes and shape, whose rows a pass already knows
        (the communication pass adds SEND/RECV nodes whose keys it placed itself)."""
        other = Wiring(None, self.microbatches, ())
        other.routes, other._ids = self.routes, self._ids
        other.moves, other.takes, other.gives = moves, takes, gives
        return other

    def _derive(self, placement: Placement, ranks) -> None:
        for rank, row in enumerate(ranks):
            shapes: dict[tuple, tuple] = {}
            moves, takes, gives = [], [], []
            for node in row:
                mb, pair = node.microbatch, node.pair
                shape = (node.kind, node.chunk, pair and pair[1])
                if (known := shapes.get(shape)) is None:
                    known = shapes[shape] = self._shape(placement, rank, node)
                first_move, first_in, first_out = known
                if first_move >= 0:
                    moves.append(first_move + mb)
                    takes.append(())
                    gives.append(())
                    continue
                moves.append(-1)
                if pair is None:  # one part: the keys of microbatch 0, or none
                    takes.append(() if first_in < 0 else (first_in + mb,))
                    gives.append(() if first_out < 0 else (first_out + mb,))
                else:
                    mbs = (mb, pair[0])
                    takes.append(tuple(k + part_mb for k, part_mb in zip(first_in, mbs) if k >= 0))
                    gives.append(tuple(k + part_mb for k, part_mb in zip(first_out, mbs) if k >= 0))
            self.moves.append(moves)
            self.takes.append(takes)
            self.gives.append(gives)

    def _first_key(self, transfer: Transfer | None) -> int:
        """The key of the transfer's route at microbatch 0 (``-1`` for no transfer)."""
        if transfer is None:
            return -1
        route = Route(*transfer[:3])
        if (found := self._ids.get(route)) is None:
            found = self._ids[route] = len(self.routes)
            self.routes.append(route)
        return found * self.microbatches

    def _shape(self, placement: Placement, rank: int, node: ScheduleNode) -> tuple:
        """``(moved, taken, given)`` keys at microbatch 0 of a node of this shape: a communication node
        moves one (the others are -1); a compute node takes and gives one per part (-1 where a part has
        none), as ints for a one-part node, as tuples for an overlapped one."""
        if not node.kind.is_compute:
            return self._first_key(transfer_of(placement, rank, node)), -1, -1
        parts = node.parts()
        taken = tuple(self._first_key(inbound(placement, rank, k, chunk, 0)) for k, _, chunk in parts)
        given = tuple(self._first_key(outbound(placement, rank, k, chunk, 0)) for k, _, chunk in parts)
        return (-1, taken, given) if node.pair is not None else (-1, taken[0], given[0])

    def transfer(self, key: int) -> Transfer:
        return Transfer(*self.routes[key // self.microbatches], key % self.microbatches)

    def key(self, transfer: Transfer) -> int | None:
        """The key of ``transfer``, None if no node of the table names its route."""
        route = self._ids.get(Route(*transfer[:3]))
        return None if route is None else route * self.microbatches + transfer.microbatch


class Pairing:
    """Which receive each send meets: per direction (sender, receiver), the k-th send meets the k-th receive, as
    every transport matches a pair's messages (gloo by peer and tag in posting order, NCCL in stream order).

    Compiled once per table (:attr:`~primuspipe.ir.table.ScheduleTable.pairing`) for the validator's pairing rule,
    its deadlock replay (:mod:`primuspipe.passes.streams`) and the simulator's streams
    (:mod:`primuspipe.simulator.transport`), which each compiled it on their own before. The table's SEND/RECV nodes are
    *ops*, numbered in row order rank by rank:

    * ``where[op]``: its ``(rank, index)``; ``key[op]``: the transfer key it moves (:class:`Wiring`);
    * ``ops[rank]``: the rank's ops; ``op_at[rank][i]``: node ``i``'s op, ``-1`` for a compute node;
    * ``side[op]``: its end of its direction on its rank, a :attr:`sides` index; ``sides[side]``: ``(rank, a node
      of it)`` -- one SEND or RECV kind and peer, which is all a transport keys a stream by;
    * ``partner[op]``: the op it meets, ``-1`` where the other side of its direction posts fewer;
    * ``swapped``: ``(send op, receive op, k)`` of each pair moving different tensors, in (sender, receiver, k)
      order (empty for a table :func:`~primuspipe.passes.validation.check_pairing` passes: then every op's partner
      moves its key);
    * ``unmatched``: how many ops have no partner (0 for a complete table).

    Weakly referable: the stream queues compiled over it per transport semantics
    (:func:`primuspipe.passes.streams.queues`) are kept as long as it is.
    """

    __slots__ = ("where", "key", "ops", "op_at", "side", "sides", "partner", "swapped", "unmatched", "__weakref__")

    def __init__(self, ranks, wiring: Wiring) -> None:
        self.where: list[tuple[int, int]] = []
        self.key: list[int] = []
        self.ops: list[range] = []
        self.op_at: list[list[int]] = []
        self.side: list[int] = []
        self.sides: list[tuple[int, ScheduleNode]] = []
        lanes: dict[tuple[int, int, bool], list[int]] = {}
        for rank, (row, moves) in enumerate(zip(ranks, wiring.moves)):
            first, at = len(self.where), [-1] * len(row)
            moving = [i for i, moved in enumerate(moves) if moved >= 0]
            self.where += [(rank, i) for i in moving]
            self.key += [moves[i] for i in moving]
            sides: dict[tuple, tuple[list[int], int]] = {}  # (kind, peer) -> its lane, its side
            for op, i in enumerate(moving, first):
                at[i] = op
                node = row[i]
                if (known := sides.get((node.kind, node.peer))) is None:
                    ends = (rank, node.peer, True) if node.kind.is_send else (node.peer, rank, False)
                    known = sides[(node.kind, node.peer)] = (lanes.setdefault(ends, []), len(self.sides))
                    self.sides.append((rank, node))
                known[0].append(op)
                self.side.append(known[1])
            self.ops.append(range(first, len(self.where)))
            self.op_at.append(at)
        self.partner = partner = [-1] * len(self.where)
        self.swapped: list[tuple[int, int, int]] = []
        key = self.key
        for (src, dst, is_send), sends in sorted(lanes.items()):
            if is_send:
                recvs = lanes.get((src, dst, False), [])
                for send, recv in zip(sends, recvs):
                    partner[send] = recv
                    partner[recv] = send
                if [key[op] for op in sends[:len(recvs)]] != [key[op] for op in recvs[:len(sends)]]:
                    self.swapped += [(send, recv, k) for k, (send, recv) in enumerate(zip(sends, recvs))
                                     if key[send] != key[recv]]
        self.unmatched = self.partner.count(-1)


@cache
def reaches(num_stages: int) -> frozenset[tuple[Step, Step]]:
    """Within one microbatch, the pairs ``(a, b)`` of steps (microbatch 0) where ``b`` depends,
    directly or transitively, on ``a``; reflexive. Microbatch-ordered searches (the MILP) use it to
    know which orders every schedule shares."""
    steps = [Step(k, s, 0) for k in split_kinds() for s in range(num_stages)]
    needs = {step: _step_needs(step, num_stages) for step in steps}
    closure: dict[Step, set[Step]] = {}

    def ancestors(step: Step) -> set[Step]:
        if step not in closure:
            closure[step] = {step}.union(*(ancestors(n) for n in needs[step]))
        return closure[step]

    return frozenset((a, b) for b in steps for a in ancestors(b))


def _step_needs(step: Step, num_stages: int) -> list[Step]:
    """What completing ``step`` needs: the needs of the single kind that completes only that step."""
    (kind,) = [k for k in all_kinds() if k.is_compute and k.spec.completes == (step.kind.name,)]
    return [Step(s, step.stage + offset, 0) for s, offset in _needs(kind, num_stages, step.stage)]


def _clear_caches() -> None:
    """What is derived from the kind table is cached; a new kind can change it."""
    for cached in (_needs, consumers, _handoffs_in, _handoffs_out, reaches):
        cached.cache_clear()


on_kinds_changed(_clear_caches)
