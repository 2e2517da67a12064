"""The FIFO weight-gradient rule: what a table must satisfy to run on Transformer Engine's deferral.

Transformer Engine (>= 2.3, ``delay_wgrad_compute=True``) keeps one first-in-first-out queue of deferred
weight-gradient GEMMs per module: every backward of the module puts its GEMM at the tail, and
``backward_dw()`` runs the one at the head. The queue carries no microbatch label, so a ``W`` node
that calls ``backward_dw`` gets the right microbatch's GEMM only if, per chunk (a chunk's modules all
see the same sequence), the weight-gradient nodes pop in the order the backwards pushed:

* ``B`` pushes its microbatch; ``W`` pops and must find its own microbatch at the head;
* a fused ``BW`` pushes and pops at once (the backend calls ``backward_dw`` right after it), so the
  queue must be empty when it runs;
* an overlapped ``FB`` node's ``B`` part pushes like a ``B``.

And the chunk's first pop must be microbatch 0's: TE records ``is_first_microbatch`` in the GEMM it
defers, and under ``fuse_wgrad_accumulation`` microbatch 0's GEMM *overwrites* ``main_grad`` instead
of adding to it, which is right only if no other microbatch's gradient is there yet.

:func:`check_fifo_weight_grads` replays those queues per rank and chunk; the Megatron backend runs it
whenever a model defers through TE, and ``primuspipe validate --fifo-weight-grads`` runs it on a file.
Pure (no torch): the rule is about the table only.
"""

from __future__ import annotations

from collections import deque

from primuspipe.errors import ValidationError
from primuspipe.ir.table import ScheduleTable

RULE = "fifo-weight-grads"


def check_fifo_weight_grads(table: ScheduleTable) -> None:
    """Raise :class:`ValidationError` (rule ``fifo-weight-grads``) at the first node that would pop
    another microbatch's deferred weight gradient from a chunk's FIFO, or pop microbatch 0's late."""
    for rank, row in enumerate(table.ranks):
        queues: dict[int, deque[int]] = {}
        popped: set[int] = set()
        for index, node in enumerate(row):
            for kind, mb, chunk in node.parts():
                queue = queues.setdefault(chunk, deque())
                if kind.is_input_grad:
                    queue.append(mb)
                if not kind.is_weight_grad:
                    continue
                head = queue.popleft() if queue else None
                if head != mb:
                    held = ", ".join(f"B{q}.{chunk}" for q in ([head] if head is not None else []) + list(queue))
                    _fail(table, rank, index,
                          f"{kind}{mb}.{chunk} would run the oldest deferred weight gradient of chunk {chunk}, which "
                          f"is {'none' if head is None else f'microbatch {head}'}'s (queued, oldest first: "
                          f"{held or 'nothing'})",
                          f"order chunk {chunk}'s weight-gradient nodes (W, BW) as its backwards (B, BW)")
                if chunk not in popped and mb != 0:
                    _fail(table, rank, index,
                          f"{kind}{mb}.{chunk} is chunk {chunk}'s first weight-gradient node, but microbatch 0's "
                          "weight GEMM overwrites main_grad (TE's is_first_microbatch with fuse_wgrad_accumulation) "
                          "and would erase it",
                          f"run microbatch 0's backward and weight gradient first on chunk {chunk}")
                popped.add(chunk)


def _fail(table: ScheduleTable, rank: int, index: int, what: str, fix: str) -> None:
    raise ValidationError(RULE, f"{table.algorithm}: rank {rank} node {index}: {what}\n"
                                f"{table.grid(marks=[(rank, index)])}\nfix: {fix}", ((rank, index),))
