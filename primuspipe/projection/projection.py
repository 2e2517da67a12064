"""Project every applicable schedule (and, with search, every layout the GPUs allow) and rank them.

For one configuration and one algorithm: build the algorithm's table for the shape (pp ranks, vpp
chunks, ``GBS / (MBS * DP)`` microbatches) and simulate it under the per-stage costs
(:mod:`~primuspipe.projection.stage_costs`). The simulated step, plus the data-parallel gradient
synchronisation and the optimizer step that follow it, is the step time. Memory per rank is the
simulated peak -- static bytes plus the activations the table actually holds in flight, B keeping what
a deferred W needs -- plus a full recompute's transient working set. Verdict against HBM: ``OOM`` above
it, ``AT-RISK`` within ``risk_margin`` of it (allocator fragmentation, communication buffers and
workspaces are not modelled), else ``FITS``.

Tokens/s per GPU is ``GBS * s / step / GPUs``; MFU is model FLOPs per step (GEMMs and causal attention,
three passes, no recompute) over ``step * GPUs * peak``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass

from primuspipe.projection.comm import gradient_sync
from primuspipe.projection.compute import Calibration, PartTimes, WorkModel, optimizer_seconds, part_times
from primuspipe.projection.framework import (
    ConfigError, Placement, PrimusPipeError, build_schedule, get_algorithm, idle_share, list_algorithms, simulate)
from primuspipe.projection.hardware_spec import HardwareSpec, check_runs_on
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.parameters import dense_buffer, embedding_params
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.stage_costs import StageCosts, stage_costs
from primuspipe.projection.static_memory import optimizer_params, optimizer_step_bytes
from primuspipe.projection.training_spec import TrainingSpec, check_compatible

logger = logging.getLogger("primuspipe.projection")
ALGORITHM_LOGGERS = ("primuspipe.algorithms", "primuspipe.search")
"""The loggers of the table builders: zb-auto's search reports its progress, which is noise in a projection."""

RISK_MARGIN = 0.10
"""Default share of HBM kept free before a configuration is called AT-RISK."""

ALGORITHM_OPTIONS = {"zb-auto": {"fills": 8, "milp_nodes": 20, "include_fixed": False}}
"""Options the projection builds algorithms with: zb-auto's work bound is smaller than its default, and it
leaves out the fixed algorithms (the projection evaluates each of them anyway), so a projection stays fast."""

SEARCH_MICRO_BATCHES = (1, 2, 4, 8)
SEARCH_VPPS = (1, 2, 4)
SEARCH_RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ProjectionResult:
    """One (configuration, algorithm): how fast, how full, whether it fits."""

    algorithm: str
    pp: int
    vpp: int
    micro_batch_size: int
    recompute: str
    """``none``, ``selective`` (with its modules) or ``full`` (with its method and layer count)."""
    data_parallel_size: int
    microbatches: int
    step_time_s: float
    pipeline_time_s: float
    """The simulated pipeline part of the step."""
    gradient_sync_s: float
    """Exposed data-parallel gradient synchronisation (the slowest rank's)."""
    optimizer_s: float
    bubble_rate: float
    peak_memory_bytes: tuple[float, ...]
    """Per pipeline rank: static bytes + simulated activation peak + recompute working set."""
    memory_breakdown: dict[str, float]
    """The fullest rank's peak: weights, gradients, optimizer, activations, recompute working set."""
    tokens_per_s_per_gpu: float
    mfu: float
    """Model FLOPs with causal attention counted once (what the kernels must compute) over step x GPUs x the
    peak of the precision the GEMMs run in (FP8's with FP8 GEMMs)."""
    verdict: str
    mfu_full_attention: float = 0.0
    """The same with the full attention square counted, as NVIDIA (NeMo, Megatron-Bridge) and AMD (Primus)
    report Model TFLOP/s."""
    exposed_communication_s: float = 0.0
    """Seconds per step a rank (the mean over pipeline ranks) waits on TP / CP / EP collectives that compute
    does not hide, over all its microbatches, plus the exposed data-parallel synchronisation."""
    note: str = ""
    """Why a row is not what its algorithm name says: zb-auto replaced by a better fixed table, or a
    degenerate schedule."""
    simulated_microbatches: tuple[int, ...] = ()
    """Empty when the pipeline was simulated at the step's own microbatch count; else the two smaller
    counts it was simulated at, the step extrapolated from them (:class:`PipelineFigures`)."""
    pipeline_flushes: int = 1
    """Pipeline schedules the step runs one after another (:attr:`TrainingSpec.local_batch_size`), each of
    ``microbatches / pipeline_flushes``."""

    def row(self) -> dict:
        """The JSON row (``--json`` contract)."""
        return dataclasses.asdict(self) | {"peak_memory_bytes": list(self.peak_memory_bytes),
                                           "simulated_microbatches": list(self.simulated_microbatches)}


@dataclass(frozen=True)
class Refusal:
    """A candidate that could not be projected (the algorithm refuses the shape, the layers do not split)."""

    algorithm: str
    pp: int
    vpp: int
    micro_batch_size: int
    recompute: str
    error: str

    def row(self) -> dict:
        return dataclasses.asdict(self)


EXTRAPOLATE_ABOVE = 8
"""Above this many microbatches per pipeline rank, a projection simulates the pipeline at smaller counts
and extrapolates (:func:`sampled_microbatches`)."""


SEARCH_WHOLE_UP_TO = 1024
"""pp x microbatches up to which a searching algorithm (zb-auto) whose answers at the sampled counts follow
no line is searched and simulated at the full count; above it the row is refused: the search's time grows
with the table (about 2 s at pp 8 x 128 microbatches, 3 s at 256, 6.5 s at 512 on this project's 2-core
host), and a projection must stay within seconds."""


LINE_TOLERANCE = 1e-3
"""How far (relative) a V algorithm's step time at a third sampled count may lie off the line through the first
two for the line to carry its step on (:meth:`Projector._carried_on`)."""


def sampled_microbatches(microbatches: int, pp: int) -> tuple[int, ...] | None:
    """The counts a long pipeline is simulated at instead of its own: ``4 pp``, ``6 pp`` and ``8 pp`` plus
    the remainder of ``microbatches`` by ``pp`` (so divisibility rules, e.g. interleaving's, hold alike),
    or None when ``microbatches`` is at most :data:`EXTRAPOLATE_ABOVE` ``* pp`` and simulated as is.

    Past its warm-up every schedule repeats a steady pattern (one F, B and W per microbatch and chunk on
    every rank), so each more microbatch adds the same time: step and busy times are linear in the count
    from there on, and two counts past the warm-up give them (:func:`extrapolate`). A projection at
    Megatron-Bridge's GBS 8192 on 16 replicas (512 microbatches at pp 8) then builds and simulates
    tables of 32 and 48 microbatches per algorithm instead of 512. The third count is simulated only
    where memory differs between the first two."""
    if microbatches <= EXTRAPOLATE_ABOVE * pp:
        return None
    rest = microbatches % pp
    return rest + 4 * pp, rest + 6 * pp, rest + 8 * pp


@dataclass(frozen=True)
class PipelineFigures:
    """What the projection takes from a simulated step: its time, each rank's busy time and memory peak."""

    step_time: float
    busy: tuple[float, ...]
    peak_memory_bytes: tuple[float, ...]
    """Per rank, static bytes + peak activation bytes."""
    peak_activation_bytes: tuple[float, ...]
    microbatches: tuple[int, ...]
    """The microbatch counts simulated (one: the step's own)."""
    ends: tuple[float, ...]
    """Per rank, when its last compute node ends."""

    @classmethod
    def of(cls, simulated, microbatches: int) -> PipelineFigures:
        return cls(simulated.step_time, tuple(r.busy_time for r in simulated.ranks),
                   tuple(r.peak_memory_bytes for r in simulated.ranks),
                   tuple(r.peak_activation_bytes for r in simulated.ranks), (microbatches,),
                   tuple(max((e for n, e in zip(r.nodes, r.ends) if n.kind.is_compute and not n.kind.on_host_stream),
                             default=0.0) for r in simulated.ranks))

    def drained(self, rank: int, seconds: float, buffered_bytes: float) -> PipelineFigures:
        """These figures with ``seconds`` more work on ``rank`` after its last node (megatron-core's deferred
        output-layer weight gradients, run in the flush): the step ends no earlier than that work. The
        ``buffered_bytes`` it reads are added to the rank's peak whole, an upper bound: the buffer is full only
        after the rank's last backward, when it holds fewer activations than at its peak."""
        if not seconds and not buffered_bytes:
            return self

        def plus(values: tuple[float, ...], extra: float) -> tuple[float, ...]:
            return tuple(v + extra if r == rank else v for r, v in enumerate(values))

        end = self.ends[rank] + seconds
        return dataclasses.replace(self, step_time=max(self.step_time, end), busy=plus(self.busy, seconds),
                                   peak_memory_bytes=plus(self.peak_memory_bytes, buffered_bytes),
                                   peak_activation_bytes=plus(self.peak_activation_bytes, buffered_bytes),
                                   ends=plus(self.ends, seconds))

    def repeated(self, flushes: int) -> PipelineFigures:
        """A step of ``flushes`` such pipelines run one after another (:attr:`TrainingSpec.local_batch_size`): each
        pays its own warm-up and drain, so times add up; the activations of one are freed before the next starts,
        so the memory peaks are one pipeline's."""
        if flushes == 1:
            return self
        return dataclasses.replace(self, step_time=self.step_time * flushes,
                                   busy=tuple(b * flushes for b in self.busy),
                                   ends=tuple(e + self.step_time * (flushes - 1) for e in self.ends))

    @property
    def bubble_rate(self) -> float:
        """The worst rank's idle share of the step (the simulator's :attr:`SimulationResult.bubble_rate`)."""
        return max(idle_share(self.step_time, b) for b in self.busy)


def _growing(runs: list[tuple[TrainingSpec, StageCosts, PipelineFigures]]) -> bool:
    """Whether every rank's memory peak rose or stayed between the runs' first two counts: only then can a
    third count show it growing on a line (a peak that fell somewhere follows none)."""
    (_, _, first), (_, _, second) = runs[:2]
    return all(b >= a for a, b in zip(first.peak_memory_bytes, second.peak_memory_bytes))


def extrapolate(samples: list[PipelineFigures], microbatches: int) -> PipelineFigures | None:
    """The figures at ``microbatches`` from ``samples`` at fewer (ascending counts): times on the line
    through the last two; each rank's memory as it is at every sample, as it settled at the last two of
    three (the shortest sample too short for the steady pattern's peak, as a cost-aware V-shape's can
    be), or on their common line where it grows with the count (GPipe holds every microbatch) -- None
    where memory follows no line (a warm-up that depends on the count, as interleaving's does when pp does
    not divide it): only the full simulation tells."""
    (m1,), (m2,) = samples[-2].microbatches, samples[-1].microbatches

    def at(m: float, a: float, b: float) -> float:
        return b + (b - a) * (m - m2) / (m2 - m1)

    def linear(values: tuple[float, ...], counts: tuple[int, ...]) -> bool:
        return all(math.isclose(at(c, *values[-2:]), v, rel_tol=1e-9, abs_tol=1.0) for c, v in zip(counts, values))

    def settled(values: tuple[float, ...]) -> bool:
        return math.isclose(values[-2], values[-1], rel_tol=1e-9, abs_tol=1.0)

    counts = tuple(s.microbatches[0] for s in samples)
    for name in ("peak_memory_bytes", "peak_activation_bytes"):
        per_rank = list(zip(*(getattr(s, name) for s in samples)))
        constant = all(math.isclose(min(v), max(v), rel_tol=1e-9, abs_tol=1.0) for v in per_rank)
        if not constant and (len(samples) < 3 or not all(settled(v) or linear(v, counts) for v in per_rank)):
            return None
    first, last = samples[-2], samples[-1]
    return PipelineFigures(
        at(microbatches, first.step_time, last.step_time),
        tuple(at(microbatches, a, b) for a, b in zip(first.busy, last.busy)),
        tuple(at(microbatches, a, b) for a, b in zip(first.peak_memory_bytes, last.peak_memory_bytes)),
        tuple(at(microbatches, a, b) for a, b in zip(first.peak_activation_bytes, last.peak_activation_bytes)),
        counts, tuple(at(microbatches, a, b) for a, b in zip(first.ends, last.ends)))


@dataclass(frozen=True)
class Projector:
    """Projects configurations of one model on one cluster."""

    model: ModelSpec
    hardware: HardwareSpec
    calibration: Calibration = Calibration()
    risk_margin: float = RISK_MARGIN
    _part_cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def evaluate(self, training: TrainingSpec, algorithm: str) -> ProjectionResult | Refusal:
        """Project one configuration under one algorithm (with ``training.vpp`` chunks per rank where the
        algorithm takes any vpp, see :func:`algorithm_vpp`)."""
        training = dataclasses.replace(training, virtual_pipeline_model_parallel_size=algorithm_vpp(algorithm, training.vpp))
        refused = dict(algorithm=algorithm, pp=training.pp, vpp=training.vpp, micro_batch_size=training.micro_batch_size,
                       recompute=recompute_label(training))
        try:
            check_compatible(self.model, training)
            check_runs_on(training, self.hardware)
            flush = training.one_flush()  # what one pipeline schedule runs; the step runs training.pipeline_flushes
            shaped = self._carried_on(flush, algorithm) or self._pipeline(flush, algorithm, flush.microbatches)
            flush, costs, figures = shaped
            training = dataclasses.replace(training, virtual_pipeline_model_parallel_size=flush.vpp)
            return self._result(training, algorithm, costs, figures)
        except PrimusPipeError as exc:
            return Refusal(**refused, error=str(exc).splitlines()[0])

    def _carried_on(self, training: TrainingSpec, algorithm: str
                    ) -> tuple[TrainingSpec, StageCosts, PipelineFigures] | None:
        """A long pipeline's figures from shorter ones (:func:`sampled_microbatches`), or None where it is
        short or its figures follow no line (it is then simulated whole); raises for a search too long to
        run whole (:data:`SEARCH_WHOLE_UP_TO`)."""
        m = training.microbatches
        if (counts := sampled_microbatches(m, training.pp)) is None:
            return None
        late = m - training.deferred_microbatches if training.defer_embedding_wgrad_compute else 0
        if late:
            # a partial deferral: every count keeps the step's last `late` microbatches (their head W in their own
            # backward, :meth:`TrainingSpec.with_microbatches`) after as many deferred ones as the count alone would
            # run, so the counts differ only by deferred microbatches of the steady pattern and the line holds
            counts = tuple(c + training.pp * -(-late // training.pp) for c in counts)
            if counts[1] >= m:
                return None
        placement = get_algorithm(algorithm).placement
        searches = placement == "any"
        runs = [self._pipeline(training, algorithm, k) for k in counts[:2]]
        figures = self._extrapolated(runs, m, searches)
        if figures is None and counts[2] < m and _growing(runs) and not searches:
            runs.append(self._pipeline(training, algorithm, counts[2]))
            figures = self._extrapolated(runs, m, searches)
        elif figures is not None and placement == "v" and counts[2] < m:
            # the V algorithms build their tables from the costs at each count, and the time a microbatch adds
            # can alternate with the count (v-half at pp 2: 0.76, 0.72, 0.71, 0.76 s per four microbatches):
            # carried on only where a third count lies on the line the first two give
            third = self._pipeline(training, algorithm, counts[2])[2]
            line = extrapolate([f for _, _, f in runs], counts[2])
            if line is None or not math.isclose(line.step_time, third.step_time, rel_tol=LINE_TOLERANCE):
                figures = None
        if figures is not None:
            shape, costs, _ = runs[0]
            return dataclasses.replace(training, virtual_pipeline_model_parallel_size=shape.vpp), costs, figures
        if searches and m * training.pp > SEARCH_WHOLE_UP_TO:
            raise PrimusPipeError(
                f"{algorithm} searches anew at every microbatch count and its answers at {', '.join(map(str, counts))} "
                f"follow no line, so its {m}-microbatch table cannot be carried on from shorter ones, and a search "
                f"that size (pp x microbatches above {SEARCH_WHOLE_UP_TO}) does not fit a projection's time; the fixed "
                f"algorithms' rows stand (`primuspipe simulate -a {algorithm}` at this count times its table)")
        return None

    @staticmethod
    def _extrapolated(runs: list[tuple[TrainingSpec, StageCosts, PipelineFigures]], microbatches: int, searches: bool
                      ) -> PipelineFigures | None:
        """:func:`extrapolate` over the runs, unless zb-auto (``searches``) chose another layout at some count or
        a table whose memory peak differs from another count's: its answer at each count is a search of its own
        within the memory budget, so no line goes through different tables' shapes or peaks."""
        if len({shape.vpp for shape, _, _ in runs}) > 1:
            return None
        if searches and len({figures.peak_memory_bytes for _, _, figures in runs}) > 1:
            return None
        return extrapolate([figures for _, _, figures in runs], microbatches)

    def _pipeline(self, training: TrainingSpec, algorithm: str, microbatches: int
                  ) -> tuple[TrainingSpec, StageCosts, PipelineFigures]:
        """The algorithm's table for ``training`` run with ``microbatches`` per replica (the global batch
        scaled to it), simulated: the configuration as the table runs it (zb-auto may pick another
        vpp), its stage costs and the step's figures."""
        info = get_algorithm(algorithm)
        if microbatches != training.microbatches:
            training = training.with_microbatches(microbatches)
        if info.placement == "any":
            return self._searched(training, algorithm, microbatches)
        costs = stage_costs(self.model, training, self.hardware, self._parts(training),
                            Placement.named(info.placement, training.pp, training.vpp))
        with _quiet(*ALGORITHM_LOGGERS):  # one projection builds many tables; their progress is noise here
            table = build_schedule(algorithm, training.pp, microbatches, training.vpp, cost=costs.cost_model(),
                                   memory_limit_bytes=self._activation_budget([costs]),
                                   **ALGORITHM_OPTIONS.get(info.name, {}))
        return training, costs, PipelineFigures.of(simulate(table, costs.cost_model()), microbatches)

    def _searched(self, training: TrainingSpec, algorithm: str, microbatches: int
                  ) -> tuple[TrainingSpec, StageCosts, PipelineFigures]:
        """:meth:`_pipeline` for an algorithm that picks its own placement ("any": zb-auto): built at vpp 1
        (interleaved) and at vpp 2 (interleaved or the V, the same stages on other ranks), each time with that
        layout's own stage costs and FITS budget (at vpp 2 the lesser of the two layouts' on each rank), so the
        bytes it plans with are the bytes its table is judged by; the faster answer is the row. Where neither
        vpp gives one, the refusals are joined in one line."""
        found, refusals = None, []
        for vpp, others in ((1, ()), (2, (Placement.vshape(training.pp),))):
            shaped = dataclasses.replace(training, virtual_pipeline_model_parallel_size=vpp)
            try:
                check_compatible(self.model, shaped)
                layouts = [stage_costs(self.model, shaped, self.hardware, self._parts(shaped), placement)
                           for placement in (Placement.interleaved(training.pp, vpp), *others)]
                with _quiet(*ALGORITHM_LOGGERS):
                    table = build_schedule(algorithm, training.pp, microbatches, vpp, cost=layouts[0].cost_model(),
                                           memory_limit_bytes=self._activation_budget(layouts),
                                           **ALGORITHM_OPTIONS.get(get_algorithm(algorithm).name, {}))
            except PrimusPipeError as exc:
                refusals.append(f"vpp {vpp}: {str(exc).splitlines()[0]}")
                continue
            costs = next(c for c in layouts if c.layout.placement == table.placement)
            figures = PipelineFigures.of(simulate(table, costs.cost_model()), microbatches)
            if found is None or figures.step_time < found[2].step_time:
                found = shaped, costs, figures
        if found is None:
            raise PrimusPipeError("; ".join(refusals))
        return found

    def _parts(self, training: TrainingSpec) -> dict[str, PartTimes]:
        """Per-part times, computed once per configuration (they do not depend on pp, vpp or the algorithm)."""
        key = dataclasses.replace(training, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=1,
                                  decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                                  defer_embedding_wgrad_compute=False)
        if key not in self._part_cache:
            self._part_cache[key] = part_times(WorkModel(self.model, training), self.hardware, self.calibration)
        return self._part_cache[key]

    def _activation_budget(self, layouts: list[StageCosts]) -> tuple[float, ...]:
        """Per rank, the activation bytes a FITS verdict leaves beside the rank's static memory, working set
        and the runtime reserve, for memory-aware algorithms: the simulator's byte peak of their table
        (:meth:`~primuspipe.ir.cost_parts.MemoryCost.peak_bytes`: a B's rise and what W keeps beyond the
        retained share included) within it is exactly a FITS verdict. Over several ``layouts`` of the same
        stages (an algorithm that may put them on the interleaved ranks or the V), the least on each rank."""
        hbm = self.hardware.hbm_bytes * (1 - self.risk_margin) - self.hardware.runtime_reserved_bytes
        return tuple(max(0.0, min(hbm - c.static[r].beside_activations - c.transient_bytes[r] for c in layouts))
                     for r in range(len(layouts[0].static)))

    def _result(self, training: TrainingSpec, algorithm: str, costs: StageCosts, simulated: PipelineFigures
                ) -> ProjectionResult:
        t, h = training, self.hardware
        deferred = t.deferred_microbatches  # of each flush
        simulated = simulated.drained(costs.layout.head_rank, costs.drain_s * deferred,
                                      costs.drain_bytes * deferred).repeated(t.pipeline_flushes)
        # the first and last stage all-reduce the embedding's gradients where the last holds a copy of the table: a
        # tied output layer's, or the one multi-token prediction embeds with (megatron-core finalize_model_grads.py,
        # _allreduce_word_embedding_grads: "share_embeddings_and_output_weights or ... mtp_num_layers", core_r0.14.0)
        shared = not self.model.untie_embeddings_and_output_weights or bool(t.mtp_num_layers)
        tied = embedding_params(self.model, t.tp) if shared and costs.layout.num_stages > 1 else 0
        sync = max(gradient_sync(p, t, h, tied_embedding=tied if r in (costs.layout.embedding_rank, costs.layout.head_rank) else 0,
                                 buckets=sum(costs.layout.counts[s] for s in costs.layout.rank_stages(r)),
                                 buffer=dense_buffer(self.model, t, costs.layout, r),
                                 first_rank=r == costs.layout.embedding_rank,
                                 forward_s=sum(costs.forward[s] for s in costs.layout.rank_stages(r)),
                                 backward_s=sum(costs.backward_input[s] + costs.backward_weight[s]
                                                for s in costs.layout.rank_stages(r)))
                   for r, p in enumerate(costs.params))
        optimizer = max(optimizer_seconds(optimizer_params(p, t), h, optimizer_step_bytes(t)) for p in costs.params)
        step = simulated.step_time + sync + optimizer
        reserved = h.runtime_reserved_bytes
        in_step = [peak + transient for peak, transient in zip(simulated.peak_memory_bytes, costs.transient_bytes)]
        # where the backward makes the gradients, its end (every gradient, no activation) is a moment of its own
        peaks = [max(moment, static.total) + reserved for moment, static in zip(in_step, costs.static)]
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        static = costs.static[worst]
        at_end = in_step[worst] < static.total
        breakdown = {"weights": static.weights, "gradients": static.gradients if at_end else static.gradients_beside_activations,
                     "optimizer": static.optimizer, "activations": 0.0 if at_end else simulated.peak_activation_bytes[worst],
                     "recompute_working_set": 0.0 if at_end else costs.transient_bytes[worst], "runtime_reserved": reserved}
        tokens = t.global_batch_size * self.model.seq_length
        work, replicas = WorkModel(self.model, t), t.tp * t.cp * t.microbatches * t.dp
        peak = (h.fp8_peak_tflops() if t.fp8 else h.peak_bf16_tflops) * 1e12 * step * t.world_size
        mfu, mfu_full = (work.model_flops(c) * replicas / peak for c in ("causal", "full"))
        exposed = sum(costs.communication) / t.pp * t.microbatches  # per rank (the stages' mean) and step
        figures = (step, simulated.step_time, sync, optimizer, simulated.bubble_rate, mfu, mfu_full, *peaks)
        if not all(math.isfinite(x) for x in figures) or not 0 < mfu_full <= 1:
            raise PrimusPipeError(f"the cost model gave a non-finite or impossible figure (step {step!r} s, "
                                  f"MFU {mfu_full!r}); check the hardware file's rates")
        return ProjectionResult(
            algorithm=algorithm, pp=t.pp, vpp=t.vpp, micro_batch_size=t.micro_batch_size, recompute=recompute_label(t),
            data_parallel_size=t.dp, microbatches=t.microbatches, step_time_s=step, pipeline_time_s=simulated.step_time,
            gradient_sync_s=sync, optimizer_s=optimizer, bubble_rate=simulated.bubble_rate, peak_memory_bytes=tuple(peaks),
            memory_breakdown=breakdown, tokens_per_s_per_gpu=tokens / step / t.world_size,
            mfu=mfu, verdict=self.verdict(max(peaks)), mfu_full_attention=mfu_full,
            exposed_communication_s=sync + exposed,
            simulated_microbatches=simulated.microbatches if len(simulated.microbatches) > 1 else (),
            pipeline_flushes=t.pipeline_flushes)

    def verdict(self, peak_bytes: float) -> str:
        if peak_bytes > self.hardware.hbm_bytes:
            return "OOM"
        return "AT-RISK" if peak_bytes > self.hardware.hbm_bytes * (1 - self.risk_margin) else "FITS"


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Only warnings from the loggers ``names`` while the block runs."""
    targets = [logging.getLogger(name) for name in names]
    levels = [target.level for target in targets]
    for target, level in zip(targets, levels):
        target.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        for target, level in zip(targets, levels):
            target.setLevel(level)


def recompute_label(training: TrainingSpec) -> str:
    t = training
    if t.recompute_granularity == "full":
        return f"full/{t.recompute_method}/{t.recompute_num_layers}"
    if t.recompute_granularity == "selective":
        return "selective/" + "+".join(t.recompute_modules)
    if t.recompute_granularity == "op":
        return "op/compiled" if t.op_recompute_compiled else "op/eager"
    return "none"


def algorithm_vpp(algorithm: str, requested: int) -> int:
    """The vpp an algorithm runs with: its required one, else the configuration's (interleaved-1f1b needs
    at least 2 chunks, so it takes its default when the configuration has 1)."""
    info = get_algorithm(algorithm)
    if info.vpp is not None:
        return info.vpp
    return requested if requested > 1 or info.default_vpp == 1 else info.default_vpp


def scale_to_nodes(training: TrainingSpec, hardware: HardwareSpec, nodes: int) -> TrainingSpec:
    """The configuration on ``nodes`` nodes: data parallelism takes whatever the GPUs allow."""
    gpus = nodes * hardware.gpus_per_node
    per_replica = training.tp * training.pp * training.cp
    if nodes < 1 or gpus % per_replica:
        raise InputError([(training.source, "tensor_model_parallel_size", training.tp),
                          (training.source, "pipeline_model_parallel_size", training.pp),
                          (training.source, "context_parallel_size", training.cp)],
                         f"{nodes} node(s) x {hardware.gpus_per_node} GPUs = {gpus} GPUs do not hold whole TP * PP * CP = "
                         f"{per_replica} replicas", "pick a node count whose GPUs are a multiple of TP * PP * CP")
    return dataclasses.replace(training, data_parallel_size=gpus // per_replica)


def candidates(model: ModelSpec, training: TrainingSpec, algorithms: list[str], search: bool
               ) -> Iterator[tuple[TrainingSpec, str]]:
    """The (configuration, algorithm) pairs to project: the given configuration under every algorithm,
    or with ``search`` every pp / vpp / micro-batch size / recompute the GPU count allows."""
    if not search:
        yield from ((training, name) for name in algorithms)
        return
    gpus, per_stage = training.world_size, training.tp * training.cp
    for name in algorithms:  # the configuration as given, its vpp, layout and recompute included
        yield dataclasses.replace(training, virtual_pipeline_model_parallel_size=algorithm_vpp(name, training.vpp)), name
    given = (training.pp, training.vpp, training.micro_batch_size, recompute_label(training))
    for pp in (p for p in range(1, gpus // per_stage + 1) if (gpus // per_stage) % p == 0 and p <= model.num_layers):
        dp = gpus // (per_stage * pp)
        for mbs in sorted({*SEARCH_MICRO_BATCHES, training.micro_batch_size}):
            local = training.local_batch_size or training.global_batch_size // dp  # one flush's samples
            if not local or training.global_batch_size % (local * dp) or local % mbs:  # 0: more replicas than samples
                continue
            for recompute in SEARCH_RECOMPUTE:
                base = _with_recompute(dataclasses.replace(
                    training, pipeline_model_parallel_size=pp, data_parallel_size=dp, micro_batch_size=mbs,
                    decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                    pipeline_model_parallel_layout=None,
                    defer_embedding_wgrad_compute=training.defer_embedding_wgrad_compute and pp > 1), recompute)
                for name in algorithms:
                    for vpp in sorted({algorithm_vpp(name, v) for v in (*SEARCH_VPPS, training.vpp)}):
                        shape = (pp, vpp, mbs, recompute_label(base))
                        if pp * vpp <= model.num_layers and (pp > 1 or vpp == 1) and (
                                shape != given or algorithm_vpp(name, training.vpp) != vpp):
                            yield dataclasses.replace(base, virtual_pipeline_model_parallel_size=vpp), name


def _with_recompute(training: TrainingSpec, recompute: str) -> TrainingSpec:
    settings = {"none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
                "selective": dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
                                  recompute_modules=("core_attn",)),
                "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
    return dataclasses.replace(training, op_recompute_compiled=False, **settings[recompute])


def project(projector: Projector, training: TrainingSpec, *, algorithms: list[str] | None = None, search: bool = False
            ) -> tuple[list[ProjectionResult], list[Refusal]]:
    """Results ranked by throughput (tokens/s per GPU, fitting ones first), and the refused candidates."""
    check_compatible(projector.model, training)
    check_runs_on(training, projector.hardware)
    names = list(algorithms or [info.name for info in list_algorithms() if not (search and info.name == "zb-auto")])
    if twice := [name for name in names if names.count(name) > 1]:  # two identical rows, or one for two names typed
        raise ConfigError(f"algorithm {twice[0]!r} is named {names.count(twice[0])} times; name each algorithm once")
    pairs = list(candidates(projector.model, training, names, search))
    results, refusals = [], []
    for k, outcome in enumerate(_evaluated(projector, pairs), 1):
        if search and k % 20 == 0:
            logger.info("projected %d of %d candidates", k, len(pairs))
        (results if isinstance(outcome, ProjectionResult) else refusals).append(outcome)
    results = [_no_worse_than_fixed(r, results) if r.algorithm == "zb-auto" else r for r in results]
    results.sort(key=lambda r: (r.verdict == "OOM", bool(r.note.startswith(DEGENERATE)), -r.tokens_per_s_per_gpu,
                                r.algorithm))
    return results, refusals


WORKERS_VARIABLE = "PRIMUSPIPE_PROJECT_WORKERS"
"""Environment variable: how many processes project the candidates (1: in this process; unset: one per core)."""


def project_workers(pairs: int) -> int:
    """Processes to project ``pairs`` candidates with: :data:`WORKERS_VARIABLE`'s count, else one per core;
    never more than the pairs, and 1 where the platform cannot fork or this process is a pool's worker
    (which may not start its own). The candidates are independent, and one algorithm's table can take
    most of a projection's time (a cost-aware V-shape at pp 8 x 512 microbatches, several seconds), so
    projecting them side by side keeps ``project`` within seconds on a few cores."""
    value = os.environ.get(WORKERS_VARIABLE, "").strip()
    if value:
        if not (value.isascii() and value.isdigit()) or int(value) < 1:  # '²'.isdigit(), and int('²') fails
            raise ConfigError(f"{WORKERS_VARIABLE}={value!r}: give a whole number of processes >= 1 (1 projects "
                              "in this process), or unset it for one per core")
        workers = int(value)
    else:
        workers = os.cpu_count() or 1
    if "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        return 1
    return max(1, min(workers, pairs))


_WORKER_PROJECTOR: Projector | None = None
"""The projector a pool's worker evaluates with (inherited at fork, not pickled)."""


def _adopt(projector: Projector) -> None:
    global _WORKER_PROJECTOR
    _WORKER_PROJECTOR = projector


def _evaluate_in_worker(pair: tuple[TrainingSpec, str]) -> ProjectionResult | Refusal:
    return _WORKER_PROJECTOR.evaluate(*pair)


def _evaluated(projector: Projector, pairs: list[tuple[TrainingSpec, str]]) -> Iterator[ProjectionResult | Refusal]:
    """Each pair's outcome, in the pairs' order, from :func:`project_workers` processes."""
    workers = project_workers(len(pairs))
    if workers == 1:
        yield from (projector.evaluate(config, name) for config, name in pairs)
        return
    with multiprocessing.get_context("fork").Pool(workers, initializer=_adopt, initargs=(projector,)) as pool:
        yield from pool.imap(_evaluate_in_worker, pairs, chunksize=1)


DEGENERATE = "degenerate"
DEGENERATE_BUBBLE = 0.5
"""A zb-auto answer idling more than this share of the step (it found no order that fits and keeps the
pipeline busy) is reported as degenerate and ranked below every working configuration."""


NEGLIGIBLE_GAIN = 0.005
"""A zb-auto table faster than the best fixed algorithm's by less than this share of the step, but holding more
memory, is not worth it: the projection's own accuracy is several per cent, and memory headroom is what a run
falls over on. zb-auto then keeps the fixed table (the README's Llama 2 7B on MI300X: its own 0.08 % faster at
171 GiB against dualpipe-v's 53)."""


def _no_worse_than_fixed(auto: ProjectionResult, results: list[ProjectionResult]) -> ProjectionResult:
    """zb-auto's row, or the fastest fixed algorithm of the same configuration that fits at least as well
    when that is faster, or within :data:`NEGLIGIBLE_GAIN` of zb-auto's own table with less memory (zb-auto keeps
    a fixed table when it beats its own constructions; the projection leaves the fixed ones out of zb-auto's
    search because it projects them anyway)."""
    rank = {"FITS": 0, "AT-RISK": 1, "OOM": 2}
    same = [r for r in results if r.algorithm != "zb-auto" and r.pp == auto.pp and r.micro_batch_size == auto.micro_batch_size
            and r.recompute == auto.recompute and r.data_parallel_size == auto.data_parallel_size
            and rank[r.verdict] <= rank[auto.verdict]]
    best = min(same, key=lambda r: r.step_time_s, default=None)
    if best is not None and best.step_time_s < auto.step_time_s:
        return dataclasses.replace(best, algorithm="zb-auto", note=f"zb-auto keeps {best.algorithm}'s table (faster than "
                                   f"its own, {auto.step_time_s:.3f} s)")
    if (best is not None and best.step_time_s < auto.step_time_s * (1 + NEGLIGIBLE_GAIN)
            and max(best.peak_memory_bytes) < max(auto.peak_memory_bytes)):
        gain = 1 - auto.step_time_s / best.step_time_s
        return dataclasses.replace(best, algorithm="zb-auto", note=(
            f"zb-auto keeps {best.algorithm}'s table (its own is {gain:.2%} faster, {auto.step_time_s:.3f} s, at "
            f"{max(auto.peak_memory_bytes) / 2**30:.1f} GiB a rank against {max(best.peak_memory_bytes) / 2**30:.1f})"))
    if auto.bubble_rate > DEGENERATE_BUBBLE:
        return dataclasses.replace(auto, note=f"{DEGENERATE}: bubble {auto.bubble_rate:.2f} (no fitting order keeps the "
                                   "pipeline busy)")
    return auto
