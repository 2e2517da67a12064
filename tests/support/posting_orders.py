"""Generated posting orders: a full table's SEND/RECV nodes moved within what the validator's rules allow.

The NCCL models (:mod:`primuspipe.passes.streams`, the simulator, the NCCL emulator) differ only in how
they treat the *order* in which a rank posts its operations, so a differential test of them needs many
orders, not the one ``add_communication`` writes. :func:`reorder` keeps every rule but the deadlock
replay true by construction -- a send stays after the compute node that produces its tensor, a receive
before the one that consumes it, and each rank's sends to a peer (and receives from it) keep their order,
so the k-th send of a direction still meets the k-th receive (pairing) -- and moves everything else: a
node drifts up to ``spread`` compute nodes from where it was, and the nodes that land between the same
two compute nodes are interleaved at random. :func:`generated_cases` draws a seeded sample over shipped
algorithms and small shapes, keeping the orders primuspipe's own transport still proves (the runner
runs nothing else).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from primuspipe.errors import ValidationError
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import validate
from shipped_tables import shipped_tables

SHAPES = ((2, 2), (2, 3), (2, 4), (3, 3), (3, 4), (3, 6), (4, 4), (4, 5))
"""(pp, microbatches) the cases are drawn from: pp 2-4, small enough for a multi-process run in a second."""
SPREADS = (0, 1, 2, 4, 64)
"""How far (in compute nodes) a node may drift; 0 keeps the exported order (``add_communication``'s, the
posting primuspipe used on one shared group before per-direction channels)."""
BATCH_WAITS = ["F0.0 SEND_F0.0>1 F1.0 RECV_B0.0<1 RECV_B1.0<1 BW0.0 SEND_F1.0>1 BW1.0",
               "RECV_F0.0<0 F0.0 BW0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 BW1.0 SEND_B1.0>0"]
"""An order the generated ones led to (pp 2, m 2, as text rows): rank 0 receives both gradients in one
batch (nodes 3-4) and sends F1.0's activation only after BW0.0, rank 1 sends the second gradient only
after that activation. Under ``nccl-batched`` the batch waits for a gradient that needs what rank 0 posts
behind it on the group's one stream, and BW0.0 waits for the whole batch (NCCL's one request per group)."""


def reorder(table: ScheduleTable, rng: random.Random, spread: int) -> ScheduleTable:
    """``table`` with each rank's communication nodes moved (module docstring); ``spread`` 0 keeps it."""
    if spread == 0:
        return table
    wiring = table.wiring
    rows = []
    for rank, row in enumerate(table.ranks):
        compute = [i for i, node in enumerate(row) if node.kind.is_compute]
        producer = {key: j for j, i in enumerate(compute) for key in wiring.gives[rank][i]}
        consumer = {key: j for j, i in enumerate(compute) for key in wiring.takes[rank][i]}
        chains: dict[tuple, list[int]] = defaultdict(list)  # (send?, peer) -> its nodes in order
        slot_of: dict[int, int] = {}  # node index -> compute nodes before it
        before = 0
        for i, node in enumerate(row):
            if node.kind.is_compute:
                before += 1
                continue
            slot_of[i] = before
            chains[node.kind.is_send, node.peer].append(i)
        slots: dict[int, list[int]] = defaultdict(list)  # slot -> its nodes (chain order kept within a chain)
        moves = wiring.moves[rank]
        for (send, _), chain in chains.items():
            lows = [producer[moves[i]] + 1 if send else 0 for i in chain]
            highs = [len(compute) if send else consumer[moves[i]] for i in chain]
            for k in range(len(chain) - 2, -1, -1):  # a node may not pass the next one of its chain
                highs[k] = min(highs[k], highs[k + 1])
            last = 0
            for i, low, high in zip(chain, lows, highs):
                wanted = slot_of[i] + rng.randint(-spread, spread)
                last = min(max(wanted, low, last), high)
                slots[last].append(i)
        new_row = []
        for j in range(len(compute) + 1):
            new_row += [row[i] for i in _interleaved(slots[j], row, rng)]
            if j < len(compute):
                new_row.append(row[compute[j]])
        rows.append(new_row)
    return table.with_ranks(rows)


def _interleaved(nodes: list[int], row, rng: random.Random) -> list[int]:
    """``nodes`` in a random order that keeps each chain's (same kind of operation, same peer) order."""
    chains: dict[tuple, list[int]] = defaultdict(list)
    for i in sorted(nodes):
        chains[row[i].kind.is_send, row[i].peer].append(i)
    heads = list(chains.values())
    out = []
    while heads:
        chain = rng.choice(heads)
        out.append(chain.pop(0))
        if not chain:
            heads.remove(chain)
    return out


@dataclass(frozen=True)
class Case:
    """One generated posting order of a shipped algorithm's table."""

    name: str
    """``algorithm pp m spread #n``: enough to rebuild it (with the seed) and to read in a failure."""
    table: ScheduleTable
    base: ScheduleTable
    """The exported table it was drawn from (same compute, so the same losses and gradients)."""


def generated_cases(count: int, seed: int) -> tuple[list[Case], int]:
    """``count`` cases drawn with ``seed`` (each a shipped table at a small shape, a spread, a reorder),
    and how many draws the validator refused under primuspipe's transport (skipped: the runner refuses them)."""
    rng = random.Random(seed)
    tables, cases, refused = shipped_tables(SHAPES, searches=False), [], 0
    while len(cases) < count:
        base = rng.choice(tables)
        spread = rng.choice(SPREADS)
        table = reorder(base, rng, spread)
        try:
            validate(table)
        except ValidationError:
            refused += 1
            continue
        name = f"{base.algorithm} pp{base.pp} m{base.microbatches} spread{spread} #{len(cases)}"
        cases.append(Case(name, table, base))
    return cases, refused
