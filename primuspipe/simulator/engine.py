"""``simulate``: replays a full table under a cost model and times every node.

Semantics are the validator's (docs/design.md §3), with time added (docs/simulator.md):

* each rank runs its nodes in table order, one at a time;
* posting a send or a receive takes the host's post time (``host.send`` / ``host.recv``, default 0)
  and never blocks the rank;
* per direction (source rank -> destination rank) the k-th send is matched with the k-th receive; each
  runs on its rank's stream of the transport ``semantics`` (:mod:`primuspipe.simulator.transport`):
  once posted and the stream's previous item completed; the transfer starts once both ends run
  (rendezvous, as NCCL's p2p kernels do) and takes ``P2PCost.transfer_time`` (links are not contended,
  but a stream is serial: a transfer waiting on its peer delays the next one on its stream);
* a compute node starts when its rank is free and its inbound transfers have arrived, plus its kind's
  host overhead; it takes its cost, plus its cold start when it is its chunk's first of its kind in the step;
* OFFLOAD / RELOAD copy on the rank's copy streams, overlapping compute
  (:mod:`primuspipe.simulator.host_copies`);
* the step ends when the last node (compute or transfer) finishes.

Ranks with a device each (``host.cores`` unset) never slow each other, so each rank is run as far as
it can go before the next (:mod:`~primuspipe.simulator.dedicated`), and because every start time is a
function of the table and the costs only, the result does not depend on that order. Ranks sharing cores
(``host.cores``) slow each other while more of them are busy than there are cores, so time must pass
for all of them together (:mod:`~primuspipe.simulator.shared`). Both loops run the table compiled to
named op records (:mod:`~primuspipe.simulator.program`) and report a step that never finishes the same
way (:mod:`~primuspipe.simulator.unfinished`); the result types are in
:mod:`~primuspipe.simulator.result`. A compute-only table gets its communication from
:func:`~primuspipe.passes.communication.add_communication` first, so transfers are costed too.
"""

from __future__ import annotations

from primuspipe import strict
from primuspipe.errors import SimulationError
from primuspipe.io.timeline import idle_share
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.communication import add_communication
from primuspipe.passes.validation import check_steps, is_proven
from primuspipe.passes.streams import DEFAULT_SEMANTICS, Semantics, semantics_named
from primuspipe.simulator.dedicated import run_dedicated
from primuspipe.simulator.memory import peak_activations
from primuspipe.simulator.program import Compute, compile_programs
from primuspipe.simulator.result import RankResult, SimulationResult
from primuspipe.simulator.shared import run_shared
from primuspipe.simulator.transport import Wires

_STEADY_STATE_ROUNDS = 50
"""With step gaps, steps are replayed until each rank enters the step at the same offset as in the
previous one (a pipeline settles in a few rounds); at most this many."""


@strict.arguments()
def simulate(table: ScheduleTable, cost: CostModel,
             semantics: Semantics | str = DEFAULT_SEMANTICS) -> SimulationResult:
    """Time ``table`` under ``cost``, its sends and receives running on the streams of the transport
    ``semantics`` (:mod:`primuspipe.passes.streams`; default primuspipe's own transport, what the runner
    runs). Raises :class:`SimulationError` if the table cannot complete under them (naming the cycle of
    waits; ``primuspipe validate --semantics NAME`` gives the full diagnosis), and a table no validation
    proved is first held to the validator's rules on each rank's steps (:func:`~primuspipe.passes.validation.check_steps`:
    :class:`ValidationError`), so a node out of order is refused rather than timed.

    >>> from primuspipe.algorithms.build import build_schedule
    >>> result = simulate(build_schedule("1f1b", pp=8, microbatches=32), CostModel.per_stage(8, f=1, b=1, w=1))
    >>> result.step_time, round(result.bubble_rate, 4)
    (117.0, 0.1795)
    """
    strict.instance(table, ScheduleTable, "simulate's table", error=SimulationError)
    strict.instance(cost, CostModel, "simulate's cost", error=SimulationError)
    if cost.num_stages != table.num_stages:
        raise SimulationError(f"the cost model describes {cost.num_stages} stages but the table has "
                              f"{table.num_stages} (pp={table.pp} x vpp={table.vpp}); build the costs for this shape")
    gaps = cost.host.step_gap
    if gaps is not None and len(gaps) != table.pp:
        raise SimulationError(f"host.step_gap has {len(gaps)} values but the table has {table.pp} ranks; give one "
                              "number or one per rank")
    if not isinstance(semantics, Semantics):
        semantics = semantics_named(semantics)
    if not is_proven(table):  # a compute-only table's rows: the transfers add_communication adds are right by making
        check_steps(table)
    full = table if table.has_communication else add_communication(table)
    wires = Wires(full, semantics)
    programs = compile_programs(full, cost, wires)
    offsets = [0.0] * full.pp
    for _ in range(1 if gaps is None else _STEADY_STATE_ROUNDS):
        if cost.host.cores is None:
            (starts, ends), cpu = run_dedicated(full, programs, wires, offsets, semantics), None
        else:
            starts, ends, cpu = run_shared(full, programs, wires, offsets, semantics, cost=cost)
        if gaps is None:
            break
        # the next step: each rank starts its step gap after its own end
        nxt = [max(e, default=o) + g for e, o, g in zip(ends, offsets, gaps)]
        nxt = [x - min(nxt) for x in nxt]
        if all(abs(a - b) <= 1e-12 * (1 + abs(a)) for a, b in zip(nxt, offsets)):
            break
        offsets = nxt
    step = max((max(e, default=0.0) for e in ends), default=0.0)
    busy = [sum(op.duration for op in program.ops if type(op) is Compute) for program in programs]
    period = None if gaps is None else min(max(e, default=o) + g - o for e, o, g in zip(ends, offsets, gaps))
    units, act_bytes = peak_activations(full, cost.memory, starts, ends)
    ranks = tuple(
        RankResult(r, full.ranks[r], tuple(starts[r]), tuple(ends[r]), busy[r],
                   idle_share(step, busy[r]), units[r], act_bytes[r], cost.static_bytes(r),
                   None if cpu is None else tuple(cpu[r]), offsets[r])
        for r in range(full.pp)
    )
    return SimulationResult(full, cost, step, ranks, period)
