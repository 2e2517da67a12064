"""Pick a better schedule from a few measured steps of the running one: the decision of in-flight re-planning.

A run measures its first steps (:mod:`primuspipe.backends.replanning` drives it); this module turns
them into a choice, with no torch and no process group, so the same decision is tested on simulated
timelines and taken on rank 0 of a live run:

* :func:`measure_costs` calibrates every term of the cost model from the steps, which ran the running
  table with a short split-backward probe (:mod:`primuspipe.passes.split_probe`), so B and W are
  measured apart from the fused BW;
* every registered algorithm whose table for the shape has the running layout -- same placement and
  vpp, so the model chunks every rank holds stay valid (1f1b, gpipe, zb-h1, zb-h2, zb-auto; zbv,
  v-half, v-min, dualpipe-v) -- is built under the measured costs (cost-aware ones plan with them) and
  simulated; a table whose predicted peak memory exceeds the limit is left out (zb-auto plans within the
  limit as the same prediction counts it: :meth:`_MemoryModel.unit_limit`);
* the fastest is chosen when it beats the running table's own prediction by more than the threshold;
* algorithms of other layouts are simulated from the per-1F1B-stage costs (the portable cost file),
  and the best is *recommended* when it would beat the choice by the threshold: switching layout
  rebuilds the model chunks, which a restart from a checkpoint does (docs/replanning.md).

Memory is predicted per rank as the memory at step start plus the simulator's peak activations times
the bytes one activation unit took in the measured steps ((peak - start) / simulated peak of the
measured table): the device's memory on GPU, resident set size on CPU.

>>> from primuspipe.algorithms.build import build_schedule
>>> from primuspipe.simulator import CostModel, simulate
>>> running = build_schedule("1f1b", pp=2, microbatches=4)
>>> cost = CostModel.per_stage(2, f=1, b=1, w=1)
>>> steps = [simulate(probed(running), cost).timeline(i) for i in range(2)]
>>> decision = decide(steps, running, ReplanSettings(enabled=True))
>>> decision.chosen, decision.switch, decision.predicted_step_time, decision.running_step_time
('zb-auto', True, 13.0, 15.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from primuspipe.algorithms import get_algorithm, list_algorithms
from primuspipe.algorithms.build import build_schedule
from primuspipe.calibration.measure import measure_costs
from primuspipe.errors import ConfigError, PrimusPipeError, UnknownAlgorithmError
from primuspipe import strict
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.timeline import Timeline
from primuspipe.passes.communication import add_communication
from primuspipe.passes.split_probe import split_backward_probe
from primuspipe.passes.validation import validate
from primuspipe.simulator import simulate


@dataclass(frozen=True)
class ReplanSettings:
    """In-flight re-planning: when to measure, how much better a schedule must be, and under what memory."""

    enabled: bool = False
    """Off by default: a run keeps the schedule it was given."""
    warmup_steps: int = 2
    """Training steps run before measuring (allocator growth, lazy initialisation and autotuning make the
    first ones slow)."""
    measure_steps: int = 3
    """Training steps measured by the run's recorder (CUDA events on GPU, CPU clocks on CPU), the running
    table with ``probe`` backwards per chunk split: the median of their iterations is calibrated."""
    probe: int = 2
    """The split probe's count (:func:`~primuspipe.passes.split_probe.split_backward_probe`): the measured
    steps run the fused backward (BW) of ``2 * probe + 1`` microbatches per chunk as B and W, ``probe`` Ws
    right after their B and the others deferred past the next microbatch's B, so B and both kinds of W
    (warm and cold) are measured apart (0: no probe; B and W are then each half of BW). Same gradients,
    bitwise."""
    threshold: float = 0.03
    """Switch only when the chosen table's predicted step is shorter than the running table's by more than
    this share (and recommend another layout only when it beats the choice by as much)."""
    memory_limit_bytes: float | None = None
    """Per-rank peak memory (bytes: allocated on GPU, resident set on CPU) a new table must stay under.
    None: the device's memory on GPU, no limit on CPU."""
    verify_steps: int = 3
    """Steps after the decision whose measured step time is logged against the prediction."""
    algorithms: tuple[str, ...] | None = None
    """The algorithms to choose among, each of the running layout (default: every registered one that is).
    Without the running algorithm among them the run always moves to the best of them -- e.g. warm up
    and measure under 1F1B's low memory, then train with the fastest split-backward schedule."""

    def __post_init__(self) -> None:
        for name in ("enabled", "probe", *STEPS, "threshold"):  # "no" is off, not truthy
            object.__setattr__(self, name, checked_setting(name, getattr(self, name),
                                                           "auto_replan" if name == "enabled" else f"auto_replan {name}"))
        if self.memory_limit_bytes is not None:
            object.__setattr__(self, "memory_limit_bytes", strict.number(
                self.memory_limit_bytes, "auto_replan memory_limit_bytes", above=0))
        if self.algorithms is not None:
            if not isinstance(self.algorithms, (str, list, tuple)):
                raise ConfigError(f"auto_replan algorithms must be names separated by commas or a list of names, got "
                                  f"{strict.show(self.algorithms)}")
            names = self.algorithms.split(",") if isinstance(self.algorithms, str) else list(self.algorithms)
            names = [n.strip() if isinstance(n, str) else n for n in names]
            if not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"auto_replan algorithms: an empty or non-text name in {self.algorithms!r}; give "
                                  "algorithm names separated by commas")
            for name in names:
                try:
                    get_algorithm(name)
                except UnknownAlgorithmError as e:
                    raise UnknownAlgorithmError(f"auto_replan algorithms: {e}") from None
            object.__setattr__(self, "algorithms", tuple(names))

    def check_layout(self, running: ScheduleTable) -> None:
        """Refuse ``algorithms`` that do not share ``running``'s layout (their tables need other model chunks)."""
        if self.algorithms is None:
            return
        layout = same_layout(running)
        if stray := [n for n in self.algorithms if n not in layout]:
            raise ConfigError(f"auto_replan algorithms {stray} do not share the running {running.algorithm} table's "
                              f"layout ({running.placement.name} placement, vpp={running.vpp}, pp={running.pp}, "
                              f"{running.microbatches} microbatches): switching needs the same model chunks; of "
                              f"this layout: {', '.join(layout)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ReplanSettings:
        """The settings the ``PRIMUSPIPE_AUTO_REPLAN*`` variables (:data:`ENV_NAMES`) give; defaults elsewhere. A
        ``PRIMUSPIPE_*`` variable naming re-planning, or all but one of its names, that is none of them
        (``PRIMUSPIPE_AUTO_REPLAN_STEP``, ``PRIMUSPIPE_AUTO_REPLA``) is
        refused with the closest one: it was ignored, and the run re-planned on the defaults (the Megatron config's
        reader refuses every unknown ``PRIMUSPIPE_*`` variable; a ``TorchPipeline`` shares the environment with
        other settings, so only those naming re-planning are checked here)."""
        known = set(ENV_NAMES.values())
        for var in sorted(env):
            if var not in known and var.upper().startswith("PRIMUSPIPE_") and (
                    "REPLAN" in var.upper() or strict.closest(var.upper(), known, cutoff=0.9)):
                raise ConfigError(f"environment variable {var} is not a re-planning setting"
                                  f"{strict.did_you_mean(var.upper(), known)}; known: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for name, var in ENV_NAMES.items():
            if (text := env.get(var)) is None:
                continue
            what = f"environment variable {var}"
            if name == "memory_limit_bytes":
                values[name] = memory_limit(text, what)
            elif name == "algorithms":
                try:
                    values[name] = cls(algorithms=text).algorithms
                except PrimusPipeError as exc:
                    raise type(exc)(f"{what}: {exc}") from None
            else:
                values[name] = checked_setting(name, text, what, text=True)
        return cls(**values)


STEPS = {"warmup_steps": 0, "measure_steps": 1, "verify_steps": 0}
""":class:`ReplanSettings`' counts of training steps, each with its least value."""
MAX_STEPS = 100_000
"""Most steps each of :data:`STEPS` may count: re-planning acts on a run's first steps, and each measured step runs
the probe and keeps its timeline until the decision; a larger figure (``1e30`` steps, an exponent slip) left the
run warming up or measuring for ever, silently."""


def checked_setting(name: str, value: Any, what: str, text: bool = False) -> Any:
    """One of :class:`ReplanSettings`' flag and number fields (``name``: ``enabled``, ``probe``, a :data:`STEPS`
    count or ``threshold``) checked with its bounds under the name the user gave it (``what``: a config key, an
    environment variable); ``text``: a count may be digit text (environment, config values)."""
    if name == "enabled":
        return strict.flag(value, what)
    if name == "threshold":
        return strict.number(value, f"{what} (a share, e.g. 0.03)", minimum=0, maximum=1)
    if name == "probe":
        return strict.count(value, what, text=text, minimum=0)
    return strict.count(value, what, text=text, minimum=STEPS[name], maximum=MAX_STEPS)


MIN_MEMORY_LIMIT = 2.0**20
"""Smallest per-rank memory limit a user may set (1 MiB): below it no table fits, so a run would measure and then
keep its schedule every time, silently -- a limit given in GB or GiB (``80``, ``1.5``) instead of bytes."""


def memory_limit(value: Any, what: str) -> float:
    """A user's ``auto_replan`` memory limit (environment or Megatron config) in bytes, at least
    :data:`MIN_MEMORY_LIMIT` (the API's :class:`ReplanSettings` takes any positive figure: tests price toy units)."""
    limit = strict.number(value, f"{what} (bytes)", above=0)
    if limit < MIN_MEMORY_LIMIT:
        raise ConfigError(f"{what} = {limit:g} bytes is below 1 MiB, less than any schedule needs, so the run would "
                          "never switch; give bytes per rank (e.g. 80e9 for 80 GB), not GB")
    return limit


ENV_NAMES = {
    "enabled": "PRIMUSPIPE_AUTO_REPLAN",
    "warmup_steps": "PRIMUSPIPE_AUTO_REPLAN_WARMUP",
    "measure_steps": "PRIMUSPIPE_AUTO_REPLAN_STEPS",
    "threshold": "PRIMUSPIPE_AUTO_REPLAN_THRESHOLD",
    "memory_limit_bytes": "PRIMUSPIPE_AUTO_REPLAN_MEMORY_LIMIT",
    "algorithms": "PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS",
    "verify_steps": "PRIMUSPIPE_AUTO_REPLAN_VERIFY",
}
""":class:`ReplanSettings` field -> the environment variable that sets it (the Megatron config's too)."""


def probed(table: ScheduleTable, count: int = 1) -> ScheduleTable:
    """What a measured step runs: ``table`` with ``count`` backwards per chunk split by the probe, where it
    has fused backwards (a split-backward table times B and W itself)."""
    if count == 0 or not any(n.kind is NodeKind.BW for row in table.ranks for n in row):
        return table
    return validate(add_communication(split_backward_probe(table.compute_only(),
                                                           min(count, table.microbatches))))


@dataclass(frozen=True)
class Candidate:
    """One algorithm's table simulated under the measured costs."""

    algorithm: str
    vpp: int
    placement: str
    step_time: float
    peak_activations: float
    """The most activations a rank holds (simulated, 1F1B-stage microbatches): the tie-break, least first."""
    peak_memory_bytes: tuple[float, ...] | None
    """Predicted per rank; None where the measured steps gave no memory figures."""
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "vpp": self.vpp, "placement": self.placement,
                "predicted_step_time_s": self.step_time, "peak_activations": self.peak_activations,
                "fits_memory": self.fits,
                "predicted_peak_memory_bytes": None if self.peak_memory_bytes is None else list(self.peak_memory_bytes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Candidate:
        peaks = d["predicted_peak_memory_bytes"]
        return cls(d["algorithm"], d["vpp"], d["placement"], d["predicted_step_time_s"], d["peak_activations"],
                   None if peaks is None else tuple(peaks), d["fits_memory"])


@dataclass(frozen=True)
class Decision:
    """What rank 0 decided from the measured steps; every rank gets it (and ``table``) by broadcast."""

    running: str
    chosen: str
    switch: bool
    table: ScheduleTable
    """The table to run from now on: the chosen one when switching, else the running one."""
    predicted_step_time: float
    """The simulated step of ``table`` under the measured costs."""
    running_step_time: float
    """The simulated step of the running table (no probe) under the same costs."""
    measured_step_time: float
    """Median step span of the measured (probed) steps."""
    ranking: tuple[Candidate, ...]
    """The running layout's algorithms, fastest first."""
    recommendation: Candidate | None = None
    """An algorithm of another layout predicted faster than the choice by more than the threshold."""
    time_unit: str = "s"
    notes: tuple[str, ...] = field(default_factory=tuple)
    cost: Mapping[str, Any] | None = None
    """The measured cost model (cost-file mapping, per model stage) every candidate was simulated under."""

    @property
    def gain(self) -> float:
        """The predicted share of the running table's step the choice saves."""
        return 1 - self.predicted_step_time / self.running_step_time if self.running_step_time else 0.0

    def log_line(self, step: int, threshold: float) -> str:
        """The one line a run logs with its choice."""
        others = ", ".join(f"{c.algorithm} {c.step_time:.4g}" + ("" if c.fits else " (over memory)")
                           for c in self.ranking)
        head = (f"primuspipe auto-replan at step {step}: switching {self.running} -> {self.chosen}, predicted step "
                f"{self.predicted_step_time:.4g} {self.time_unit} ({self.gain:+.1%} vs {self.running}'s predicted "
                f"{self.running_step_time:.4g}; threshold {threshold:.1%})" if self.switch else
                f"primuspipe auto-replan at step {step}: keeping {self.running}, predicted step "
                f"{self.predicted_step_time:.4g} {self.time_unit} (best of its layout: {self.chosen}, gain "
                f"{1 - self.ranking[0].step_time / self.running_step_time:+.1%}, threshold {threshold:.1%})")
        tail = f"; measured {self.measured_step_time:.4g} {self.time_unit} (with probe); ranking: {others}"
        if (r := self.recommendation) is not None:
            tail += (f"; recommended: {r.algorithm} ({r.placement} placement, vpp={r.vpp}) predicted "
                     f"{r.step_time:.4g} {self.time_unit} -- it needs other model chunks: save a checkpoint and "
                     f"restart with pp_algorithm={r.algorithm} (checkpoints load under any schedule)")
        return head + tail

    def to_dict(self) -> dict[str, Any]:
        return {"running": self.running, "chosen": self.chosen, "switch": self.switch, "gain": self.gain,
                "predicted_step_time_s": self.predicted_step_time, "running_predicted_step_time_s":
                self.running_step_time, "measured_step_time_s": self.measured_step_time,
                "ranking": [c.to_dict() for c in self.ranking],
                "recommendation": None if self.recommendation is None else self.recommendation.to_dict(),
                "time_unit": self.time_unit, "notes": list(self.notes), "cost_model": self.cost}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], table: ScheduleTable) -> Decision:
        """The decision :meth:`to_dict` wrote, with the ``table`` it chose (sent beside it as text)."""
        recommendation = d["recommendation"]
        return cls(d["running"], d["chosen"], d["switch"], table, d["predicted_step_time_s"],
                   d["running_predicted_step_time_s"], d["measured_step_time_s"],
                   tuple(map(Candidate.from_dict, d["ranking"])),
                   None if recommendation is None else Candidate.from_dict(recommendation), d["time_unit"],
                   tuple(d["notes"]), d["cost_model"])


def same_layout(table: ScheduleTable) -> list[str]:
    """Registered algorithms whose table for ``table``'s shape has its placement and vpp."""
    return [name for name, built in _buildable(table.pp, table.microbatches, table.vpp)
            if built.placement == table.placement and built.vpp == table.vpp]


def _buildable(pp: int, m: int, vpp: int | None, cost: CostModel | None = None,
               memory_limit: float | None = None) -> list[tuple[str, ScheduleTable]]:
    """Every registered algorithm's table for the shape (``vpp`` None: each algorithm's own), where it builds."""
    out = []
    for info in list_algorithms():
        if info.alias_of is not None or (vpp is not None and info.vpp is not None and info.vpp != vpp):
            continue
        want = vpp if vpp is not None else info.resolve_vpp(None)
        try:
            out.append((info.name, build_schedule(info.name, pp, m, want, cost=_for(cost, pp, want),
                                                  memory_limit=memory_limit)))
        except PrimusPipeError:  # the algorithm refuses this shape
            continue
    return out


def _for(cost: CostModel | None, pp: int, vpp: int | None) -> CostModel | None:
    """``cost`` for ``pp * vpp`` stages (it is per 1F1B stage or already for that shape)."""
    return cost if cost is None or vpp is None else cost.for_shape(pp, vpp)


def decide(timelines: Sequence[Timeline], running: ScheduleTable, settings: ReplanSettings, *,
           memory_capacity_bytes: float | None = None) -> Decision:
    """The decision from merged timelines of measured steps of ``running`` (with its probe, as
    :func:`probed` makes it). ``memory_capacity_bytes``: the device's memory, the limit when the
    settings give none."""
    measured = replace(measure_costs(timelines, warmup=0), step_gap=None)
    pp, m, vpp = running.pp, running.microbatches, running.vpp
    cost = CostModel.from_dict(measured.cost_dict(per_model_stage=True), pp=pp, vpp=vpp)
    portable = CostModel.from_dict(measured.cost_dict(), pp=pp, vpp=1)  # per 1F1B stage: any vpp
    limit = settings.memory_limit_bytes if settings.memory_limit_bytes is not None else memory_capacity_bytes
    memory = _MemoryModel.of(timelines, simulate(_executed(timelines[0], running), cost).peak_activations, limit)
    built = {name: table for name, table in _buildable(pp, m, vpp, cost, memory.unit_limit())
             if table.placement == running.placement}
    layout = set(built)
    if settings.algorithms is not None:
        built = {name: table for name, table in built.items() if name in settings.algorithms}
    ranking = [_candidate(name, table, cost, memory) for name, table in built.items()]
    own = simulate(running, cost).step_time
    # the running table's own order (under any name) ranks first among equals: no switch for nothing
    ranking.sort(key=lambda c: (not c.fits, c.step_time * (1 - 1e-9 * (built[c.algorithm].ranks == running.ranks)),
                                c.peak_activations, c.algorithm))
    best = ranking[0] if ranking and ranking[0].fits else None
    leaving = settings.algorithms is not None and running.algorithm not in settings.algorithms
    switch = best is not None and built[best.algorithm].ranks != running.ranks and (
        leaving or (own > 0 and 1 - best.step_time / own > settings.threshold))
    chosen_table = built[best.algorithm] if switch else running
    predicted = simulate(chosen_table, cost).step_time
    others = [_candidate(name, table, _for(portable, pp, table.vpp), None)
              for name, table in _buildable(pp, m, None, portable) if name not in layout]
    faster = sorted((c for c in others if c.step_time < predicted * (1 - settings.threshold)),
                    key=lambda c: (c.step_time, c.peak_activations, c.algorithm))
    notes = list(measured.notes)
    if memory.note:
        notes.append(memory.note)
    return Decision(running.algorithm, best.algorithm if best else running.algorithm, switch, chosen_table, predicted,
                    own, statistics.median(t.step_time for t in timelines), tuple(ranking),
                    faster[0] if faster else None, measured.time_unit, tuple(notes),
                    measured.cost_dict(per_model_stage=True))


def _executed(timeline: Timeline, running: ScheduleTable) -> ScheduleTable:
    """The table the measured steps ran (the running one with its probe), from the timeline's node order."""
    from primuspipe.calibration.replay import run_table

    return run_table(timeline, running.placement)


def _candidate(name: str, table: ScheduleTable, cost: CostModel, memory: _MemoryModel | None) -> Candidate:
    result = simulate(table, cost)
    peaks = memory.predict(result.peak_activations) if memory is not None else None
    fits = peaks is None or memory.limit is None or max(peaks) <= memory.limit
    return Candidate(name, table.vpp, table.placement.name, result.step_time, max(result.peak_activations), peaks,
                     fits)


@dataclass(frozen=True)
class _MemoryModel:
    """Per rank: memory at step start and bytes per simulated activation unit (see the module docstring)."""

    start: tuple[float, ...] | None
    per_unit: tuple[float, ...] | None
    limit: float | None
    note: str | None = None

    @classmethod
    def of(cls, timelines: Sequence[Timeline], simulated_units: Sequence[float], limit: float | None) -> _MemoryModel:
        starts: dict[int, list[float]] = {}
        peaks: dict[int, list[float]] = {}
        for t in timelines:
            facts = {f["rank"]: f for f in t.meta.get("ranks", ())}
            for rt in t.ranks:
                at_start = facts.get(rt.rank, {}).get("memory_at_start")
                if rt.peak_memory_bytes is None or at_start is None:
                    return cls(None, None, limit, "no memory figures in the measured steps: memory not predicted")
                starts.setdefault(rt.rank, []).append(at_start)
                peaks.setdefault(rt.rank, []).append(rt.peak_memory_bytes)
        pp = len(simulated_units)
        start = tuple(min(starts[r]) for r in range(pp))
        per_unit = tuple(max(0.0, max(peaks[r]) - start[r]) / units if units > 0 else 0.0
                         for r, units in enumerate(simulated_units))
        return cls(start, per_unit, limit)

    def unit_limit(self) -> float | None:
        """The limit as activation units (the simulator's ``peak_activations``) that keep every rank's
        :meth:`predict` within it -- the tightest rank's -- for the memory-aware algorithms (zb-auto) to plan
        within, so what they build is judged by the count they planned with. None: no limit, memory not
        predicted, or no room at all (every candidate is then judged over the limit)."""
        if self.start is None or self.limit is None:
            return None
        room = [(self.limit - s) / k for s, k in zip(self.start, self.per_unit) if k > 0]
        return min(room) if room and min(room) > 0 else None

    def predict(self, units: Sequence[float]) -> tuple[float, ...] | None:
        if self.start is None:
            return None
        return tuple(s + u * k for s, u, k in zip(self.start, units, self.per_unit))


def check_settings_kind(value: Any) -> ReplanSettings:
    """``auto_replan`` as a backend option: True/False or :class:`ReplanSettings`."""
    if isinstance(value, ReplanSettings):
        return value
    if isinstance(value, bool):
        return ReplanSettings(enabled=value)
    raise ConfigError(f"auto_replan must be True, False or a ReplanSettings, got {strict.show(value)}")


def prediction_error(measured: float, predicted: float) -> float:
    """``(predicted - measured) / measured`` (0 for a zero measurement)."""
    return (predicted - measured) / measured if measured and math.isfinite(measured) else 0.0


__all__ = ["ENV_NAMES", "Candidate", "Decision", "ReplanSettings", "check_settings_kind", "decide", "prediction_error",
           "probed", "same_layout"]
