"""Measured cost models: the simulator's costs learnt from timelines of real steps.

A run dump (``dump_pp_data``, see docs/pp_vis.md) times every node of a step; the simulator wants a
cost model. :func:`measure_costs` goes from one to the other, so ``primuspipe simulate --cost FILE``
replays the measured step and ranks other algorithms under the measured costs. Every term of the cost
model is measured (docs/simulator.md, "Calibration"):

* **compute** -- per (model stage, kind), the mean node time of each iteration, then the median over
  the iterations kept (the first ``warmup`` iterations are dropped: allocator growth, autotuning and
  lazy initialisation make them slow). A chunk's first node of a kind in a step is left out of the
  mean; how much longer it takes than the rest is its **cold start** (median over ranks and chunks).
  FB nodes (an F overlapped with a B) give ``fb_overlap``. Warm W nodes (right after their own B or
  another W of their chunk, :func:`~primuspipe.ir.row_context.warm_weight_grad`) are timed apart: where
  a stage ran W in both contexts, ``compute.w`` is the cold ones' and ``compute.w_warm`` theirs; in one
  context only, that is its W, whatever the context (a run whose Ws took the same in both writes no
  ``w_warm``). Nodes that open a probe window (:func:`~primuspipe.ir.row_context.probe_windows`: the first
  to run while the split probe's deferred W is pending) are timed apart too: per rank, the median share by
  which they took longer than their kind's others is ``compute.probe_window``, and the times are the others'.
* **host** -- a rank's time between nodes. Walking each rank's nodes in table order, the rank is free
  to go on at the end of its last compute node or posting, or, for a compute node whose input arrived
  later, at that arrival (a receive's end: when the runner got the tensor); a posting's host time is
  from then to its stamp (posts are stamped once made), a compute node's from then to its start.
  Medians per kind.
* **p2p** -- a compute node that waited for its input (the input arrived later than the rank was free
  by more than an input-less node's host time, i.e. more than taking an already-arrived input takes)
  gives one sample of the transfer time: the arrival minus the later of the two postings (median).
  Where events carry message sizes of at least two kinds, ``latency + bytes / bandwidth`` is fitted.
* **cores** -- ranks on one host's CPUs may slow each other (and other processes may slow them).
  Events of such a run carry their thread's CPU time; the effective number of cores the ranks shared
  is fitted from it (:func:`~primuspipe.calibration.crowding.effective_cores`). When it is below ``pp``, ``host.cores`` is set, work is
  what a node took of its thread's CPU time, not its wall time (a node that waited for a core took
  longer without working more), host times are CPU times too, and the CPU each process spent outside
  its main thread (communication and runtime threads), over the time the rank's step took, is
  ``host.background``: a share of a core (it follows the step's length, not its message count).
  Where the ranks outnumbered the free cores, a node took more CPU the more ranks were busy beside it;
  that share is ``host.contention`` (:mod:`~primuspipe.calibration.crowding`), and node times are taken at no
  crowding.

The pieces: :mod:`~primuspipe.calibration.walk` (a run's nodes in table order, each with when its rank
was ready), :mod:`~primuspipe.calibration.estimators` (each term's samples and how they are pooled),
:mod:`~primuspipe.calibration.crowding` (the cores ranks shared and what crowding cost) and
:mod:`~primuspipe.calibration.measured` (the result and its cost file); this module puts them together.

Any timeline of the shared format works, simulated ones too, which is how the round trip simulate ->
calibrate -> simulate is tested, exactly.

The cost file is written per *1F1B stage* by default (``pp`` values: 1F1B stage ``k`` is the sum of
model stages ``k*vpp .. k*vpp+vpp-1``), so it serves every algorithm of the same ``pp`` whatever its
vpp (docs/simulator.md); ``per_model_stage=True`` writes ``pp * vpp`` values instead, exact for this
shape only. At vpp = 1 the two are the same.

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.simulator import CostModel, simulate
>>> timeline = simulate(build_schedule("zb-h1", pp=2, microbatches=4), CostModel.per_stage(2, 1, [2, 3], 1)).timeline()
>>> measured = measure_costs([timeline])
>>> measured.forward, measured.backward_input, measured.backward_weight
((1.0, 1.0), (2.0, 3.0), (1.0, 1.0))
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from primuspipe import strict
from primuspipe.calibration.crowding import (REPLAY_TOLERANCE, background_per_message, background_shares,
                                             contention_from_walks, effective_cores, lone_speed, replayed_cores)
from primuspipe.calibration.estimators import (Samples, cold_start_extras, medians, run_gaps, step_gaps, transfer_fit,
                                               window_share)
from primuspipe.calibration.measured import MeasuredCosts, significant
from primuspipe.ir.cost_model import negligible
from primuspipe.calibration.replay import placement_of
from primuspipe.calibration.runs import Screened, screen_runs
from primuspipe.calibration.walk import walk
from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.placement import Placement
from primuspipe.io.timeline import Timeline


def _timed_kinds() -> dict[str, NodeKind]:
    """Cost key (``f``, ``b``, ``w``, ``bw``) -> the single-part compute kind it times."""
    return {k.spec.cost: k for k in compute_kinds() if k.spec.cost and not k.spec.parts}


def fixed_parts(times: dict[str, list], outside: dict[str, list], fused_only: list[int]) -> dict[str, tuple[float, ...]]:
    """Per cost key, each stage's time outside some parts of the model (``MeasuredCosts.fixed`` and
    ``chunk``), for the keys timed on every stage with those parts timed too (a fused-only stage's B and
    W: half of BW's, as their times); at most the stage's time."""
    out = {}
    for key, parts in outside.items():
        if key in ("b", "w") and fused_only and outside.get("bw"):
            parts = [outside["bw"][s] / 2 if s in fused_only and outside["bw"][s] is not None else x
                     for s, x in enumerate(parts)]
        if parts and None not in parts and None not in times[key]:
            out[key] = tuple(significant(min(x, t)) for x, t in zip(parts, times[key]))
    return out


def last_from_others(chunk: tuple[float, ...]) -> tuple[float, ...]:
    """Per stage, the fixed cost a chunk pays, with the last model stage's taken as the median of the
    others': its own measure still holds the output layer and the loss, which are not timed apart
    (:mod:`primuspipe.backends.megatron.layer_timing`)."""
    if len(chunk) < 2:
        return chunk
    return (*chunk[:-1], significant(min(chunk[-1], statistics.median(chunk[:-1]))))


@strict.arguments()
def measure_costs(timelines: Sequence[Timeline], placement: Placement | None = None, *,
                  warmup: int = 1) -> MeasuredCosts:
    """Costs from timelines of one table shape (a run's iterations, oldest first). The first
    ``warmup`` are dropped when more remain; otherwise all are used and ``notes`` says so."""
    return measure_runs([timelines], placement, warmup=warmup)


@strict.arguments()
def measure_runs(runs: Sequence[Sequence[Timeline]], placement: Placement | None = None, *,
                 warmup: int = 1) -> MeasuredCosts:
    """Costs from several runs of one table shape (each a run's iterations, oldest first), pooled:
    each run's first ``warmup`` iterations are dropped, then any run whose median step lies far
    outside the others' (:mod:`~primuspipe.calibration.runs`: a slow moment of the host, not a cost),
    which ``dropped_runs`` and ``notes`` name."""
    return measure_screened(screen_runs(runs, warmup), placement)


def measure_screened(screened: Screened, placement: Placement | None = None) -> MeasuredCosts:
    """Costs from the iterations :func:`~primuspipe.calibration.runs.screen_runs` kept."""
    used = screened.used
    first = used[0]
    placement = placement or placement_of(first)
    notes = list(screened.notes)
    walks = [list(walk(t, placement)) for t in used]  # every rank's nodes in table order, once per timeline
    cores = effective_cores(used, walks)
    background = [share for t in used for share in background_shares(t)] if cores is not None else []
    background_share = significant(statistics.median(background)) if background else None
    rate, message_cpu = background_share, None  # host.background: all of it, or the part apart from messages
    if cores is not None and (per_message := background_per_message(used)) is not None:
        rate, message_cpu = per_message
        notes.append(f"each rank's process spent {rate:.3g} of a core outside its main thread over its step and "
                     f"{message_cpu:.3g} per message it sent or received (fitted over ranks with different message "
                     "counts): host.background and host.message_cpu")
    contention, slowdowns = None, [{} for _ in used]
    if cores is not None and (free := cores - (background_share or 0.0) * first.pp) > 0:
        contention, slowdowns, fitted = contention_from_walks(walks, placement, free)
        if contention is not None:
            notes.append(f"a node took {contention:.3g} more CPU for each rank busy beyond the {free:.3g} free cores "
                         f"(fitted over {fitted} nodes): compute times are taken at no crowding, and "
                         "host.contention charges it back where a schedule crowds the cores")
    probe_window, samples = window_share([Samples.of(steps, placement, use_cpu=cores is not None, slowdown=slowdown)
                                          for steps, slowdown in zip(walks, slowdowns)], placement)
    if probe_window is not None:
        notes.append(f"nodes that opened the split probe's windows (the first to run with a deferred W pending in a "
                     f"fused-backward step) took {', '.join(f'{x:.3g}' for x in probe_window)} longer (per rank) than "
                     "the same kind's others: compute times are taken outside them, and compute.probe_window charges "
                     "each rank's share where a window of deferred Ws opens")
    n = placement.num_stages

    def median_of(kind: NodeKind, field: str = "durations") -> list[float | None]:
        out: list[float | None] = []
        for stage in range(n):
            means = [statistics.fmean(d) for s in samples if (d := getattr(s, field).get((kind, stage)))]
            out.append(significant(statistics.median(means)) if means else None)
        return out

    times = {key: median_of(kind) for key, kind in _timed_kinds().items()}
    f, b, w, bw = (times[key] for key in ("f", "b", "w", "bw"))
    hot = median_of(NodeKind.W, "warm")  # warm Ws (compute.w_warm)
    both = [x is not None and y is not None for x, y in zip(w, hot)]
    w[:] = [x if x is not None else y for x, y in zip(w, hot)]  # a stage whose Ws all ran warm
    fused_only = []
    for stage in range(n):
        if f[stage] is None:
            raise TableFormatError(f"stage {stage} has no forward (F) node to time; the timeline must run "
                                   "standalone F nodes on every stage")
        if b[stage] is None or w[stage] is None:
            if bw[stage] is None:
                raise TableFormatError(f"stage {stage} has neither B and W nodes nor a BW node to time its "
                                       "backward; the timeline must run every stage's backward")
            b[stage] = w[stage] = bw[stage] / 2
            fused_only.append(stage)
    written = {key: kind for key, kind in _timed_kinds().items() if key in ("f", "b", "w", "bw")}  # what the file has
    fixed, chunk = (fixed_parts(times, {key: median_of(kind, field) for key, kind in written.items()}, fused_only)
                    for field in ("fixed", "chunk"))
    if fixed:
        notes.append(f"compute.fixed ({', '.join(sorted(fixed))}): each node's time outside the model's layers, from the "
                     "dump's layer times; cut for another vpp, every chunk pays its own (compute.chunk)")
    if fused_only:
        notes.append(f"stage(s) {', '.join(map(str, fused_only))} ran only fused BW: B and W are each taken as "
                     "half of it (only schedules that split them depend on this)")
    fused = None
    if any(x is not None for x in bw):
        fused = tuple(bw[s] if bw[s] is not None else b[s] + w[s] for s in range(n))
    overlaps = [min(1.0, max(0.0, (f[fs] + b[bs] - d) / min(f[fs], b[bs])))
                for s in samples for fs, bs, d in s.pairs if min(f[fs], b[bs]) > 0]
    cold = cold_start_extras(samples, n, fused_only)
    # a time so small beside the nodes' that no sum with them keeps it is a clock difference's float noise
    longest = max(t for t in (*f, *b, *w, *(fused or ())) if t is not None)
    host_overhead = {k: negligible(v, longest) for k, v in medians(s.host for s in samples).items()}
    host_post = {k: negligible(v, longest) for k, v in medians(s.post for s in samples).items()}
    latency, bandwidth, size = transfer_fit(samples)
    if latency is None and first.pp > 1:
        notes.append("no node waited on its input's transfer (each had arrived when its node was reached), so no "
                     "p2p latency was measured and simulate counts none: give p2p.intra_node.latency by hand if "
                     "the link's matters")
    elif negligible(latency, longest) == 0.0:
        notes.append(f"the waited-for transfers took {latency:.3g} {first.time_unit} after both ends were posted, float "
                     "noise of clock readings that agree: taken as no latency (the transfers took less than the "
                     "clocks resolve)")
        latency = 0.0

    def host_time(kind: NodeKind) -> float:
        """What the rank spends on the host before a node of ``kind`` (as measured just above)."""
        if kind.is_compute:
            return host_overhead.get(kind.name.lower(), 0.0)
        return host_post.get("post_send" if kind.is_send else "post_recv", 0.0)

    gaps = run_gaps([step_gaps(run, host_time) for run in screened.runs])
    if gaps is None and any(t.iteration + 1 in {u.iteration for u in run} for run in screened.runs for t in run
                            if "t0_unix" in t.meta):
        notes.append("no host.step_gap: consecutive iterations were dumped, but their wall-clock stamps (meta.t0_unix) "
                     "put a rank's next step before its last one ended (clocks or stamps out of order), so the gap "
                     "between steps was not measured and simulate counts none")
    peaks = []
    for rank in range(first.pp):
        seen = [rt.peak_memory_bytes for t in used for rt in t.ranks
                if rt.rank == rank and rt.peak_memory_bytes is not None]
        peaks.append(max(seen) if seen else None)
    measured = MeasuredCosts(
        first.algorithm, first.pp, first.vpp, first.microbatches, first.time_unit,
        tuple(t.iteration for t in used), tuple(f), tuple(b), tuple(w), fused,
        significant(statistics.median(overlaps)) if overlaps else None, latency,
        tuple(peaks), tuple(dict.fromkeys(notes)), cold, host_overhead,
        {k.removeprefix("post_"): v for k, v in host_post.items()}, bandwidth, size, cores,
        rate, contention and significant(contention), gaps, fixed,
        {key: last_from_others(parts) for key, parts in chunk.items() if key in fixed},
        warm if (warm := tuple(y if two else x for x, y, two in zip(w, hot, both))) != tuple(w) else None,
        screened.dropped, None if cores is None else lone_speed(walks), probe_window, message_cpu,
    )
    if cores is None:
        return measured
    replayed = replayed_cores(measured, used, placement)
    refit = "" if replayed == cores else (f"; {cores:g} by that fit, with which the run's own node order replayed more "
                                          f"than {REPLAY_TOLERANCE:.0%} off its step time")
    alone = () if measured.speed is None else (
        f"a rank running alone got {measured.speed:.3g} of a core (its nodes' CPU time over their time while no other "
        "rank was busy: a hypervisor, interrupts, other threads): host.speed charges that wherever a rank runs, "
        "host.cores only where ranks share",)
    return replace(measured, cores=replayed, notes=(*measured.notes, *alone, (
        f"the {first.pp} ranks ran as if sharing {replayed:g} cores (fitted from how much longer than their CPU time "
        f"nodes took while others were busy{refit}): compute and host times are CPU times, and host.cores makes the "
        "simulator share the cores the same way")))
