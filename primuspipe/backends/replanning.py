"""In-flight re-planning: measure the first steps, pick the schedule the simulator ranks first, switch.

Both backends (Megatron's forward-backward function, ``TorchPipeline``) hold one
:class:`InFlightReplanner` when ``auto_replan`` is on and ask it, at every training step, which table
to run; forward-only calls are not counted. Per running table (one per shape):

1. ``warmup_steps`` steps run it as given;
2. ``measure_steps`` steps run it with a short split-backward probe
   (:func:`~primuspipe.calibration.replan_decision.probed`), timed by the run's own recorder -- the one
   ``dump_pp_data`` uses: CUDA events on GPU, CPU clocks on CPU;
3. after the last of them, every pipeline rank sends its timelines to pipeline rank 0; global rank 0
   calibrates and decides (:func:`~primuspipe.calibration.replan_decision.decide`), logs one line with the
   choice and its predicted step time, and broadcasts the decision and the table's text to every rank
   of the world (data-parallel replicas run the same table); every rank reads the table back and
   all of them check they hold the same one (a digest of its text, :func:`check_same_table`) before
   any runs it; the switch happens at the next step boundary;
4. the next ``verify_steps`` steps (after one more where the table changed: a new table's first step
   allocates and warms up) are timed again: global rank 0 logs each one's measured step span
   (first node start to last node end over the pipeline's ranks, what the simulator predicts) and its
   prediction error, and, when dumping, keeps all of it in ``<dump_dir>/replan.json``; each dumped
   step's timeline says in ``meta.replan`` which table ran and its predicted step.

Algorithms of another layout (placement or vpp) would need other model chunks: they are recommended
in the log line, never switched to. A decision that cannot be taken (calibration refuses the steps)
is logged as a warning on rank 0 and the run keeps its table.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from primuspipe.calibration.replan import ReplanSettings
from primuspipe.calibration.replan_decision import Decision, decide, prediction_error, probed
from primuspipe.errors import ConfigError, PrimusPipeError
from primuspipe.documents import write_atomically
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.run_dumps import merge_rank_timelines
from primuspipe.io.timeline import Timeline
from primuspipe.runtime.driver import check_same_table

logger = logging.getLogger("primuspipe.replan")


@dataclass
class _State:
    """Where one running table is in the warm-up / measure / decide / verify sequence."""

    steps: int = 0
    measured: list[Timeline] = field(default_factory=list)
    decision: Decision | None = None
    table: ScheduleTable | None = None
    """What runs after the decision (the chosen table, or the running one)."""
    decided_at: int | None = None
    verify_from: int = 0
    """The first step timed against the prediction: after the decision, one later where the table changed
    (a new table's first step allocates its buffers and warms its code paths, as the run's first steps did)."""
    verified: list[dict[str, float]] = field(default_factory=list)
    failure: str | None = None
    """Why no decision could be taken (the run then keeps its table, unprobed and untimed)."""


@dataclass(frozen=True)
class StepPlan:
    """What one training step runs and whether it is timed."""

    table: ScheduleTable
    record: bool
    dump_meta: dict[str, Any] | None


class InFlightReplanner:
    """Chooses each training step's table for one rank of a pipeline (see the module docstring).

    ``group`` is the pipeline's process group; decisions are broadcast over the default (world) group,
    whose rank 0 must be pipeline rank 0 of its pipeline (Megatron's and torchrun's usual order)."""

    def __init__(self, settings: ReplanSettings, group: Any, device: torch.device, dump_dir: str | None = None):
        self.settings = settings
        self.group = group
        self.device = device
        self.dump_dir = dump_dir
        self.pp_rank = dist.get_rank(group)
        self.rank = dist.get_rank()
        if self.rank == 0 and self.pp_rank != 0:
            raise ConfigError(f"auto_replan: global rank 0 is pipeline rank {self.pp_rank}, but it decides for the "
                              "pipeline whose rank 0 it must be; order the ranks so that global rank 0 holds the "
                              "first pipeline stage (Megatron's default order does)")
        self._states: dict[ScheduleTable, _State] = {}

    def plan(self, running: ScheduleTable) -> StepPlan:
        """This training step's table for the ``running`` table (the one the run was configured with)."""
        if (state := self._states.get(running)) is None:
            self.settings.check_layout(running)  # the same refusal on every rank, before any step
            state = self._states[running] = _State()
        s = self.settings
        if state.steps < s.warmup_steps or state.failure is not None:
            return StepPlan(running, False, None)
        if state.decision is None:
            return StepPlan(probed(running, s.probe), True, None)
        table = state.table
        meta = {"replan": {"algorithm": table.algorithm, "predicted_step_time_s": state.decision.predicted_step_time,
                           "decided_at_step": state.decided_at}}
        return StepPlan(table, state.steps >= state.verify_from and len(state.verified) < s.verify_steps, meta)

    def after_step(self, running: ScheduleTable, timeline: Timeline | None) -> None:
        """Count the step just run for ``running``; ``timeline`` is its recorded timeline when it was timed."""
        state = self._states[running]
        state.steps += 1
        if timeline is None or state.steps <= self.settings.warmup_steps or state.failure is not None:
            return  # a dumped warm-up step (or any step after a failed decision) is not measured
        if state.decision is None:
            state.measured.append(timeline)
            if len(state.measured) == self.settings.measure_steps:
                self._decide(running, state)
        elif state.steps > state.verify_from and len(state.verified) < self.settings.verify_steps:
            self._verify(state, timeline)

    def summary(self, running: ScheduleTable) -> dict[str, Any] | None:
        """The decision and the verified steps for ``running``, or why none was taken (None before)."""
        state = self._states.get(running)
        if state is None or (state.decision is None and state.failure is None):
            return None
        if state.failure is not None:
            return {"decided_at_step": state.decided_at, "failure": state.failure, "replanned_to": None}
        measured = [v["measured_step_time_s"] for v in state.verified]
        out = {"decided_at_step": state.decided_at, "first_verified_step": state.verify_from,
               "threshold": self.settings.threshold, **state.decision.to_dict(),
               "replanned_to": state.table.algorithm if state.decision.switch else None,
               "verified_steps": list(state.verified)}
        if measured:
            median = statistics.median(measured)
            out.update(measured_step_time_after_s=median,
                       prediction_error=prediction_error(median, state.decision.predicted_step_time))
        return out

    # -- the collectives -------------------------------------------------------------------------------

    def _decide(self, running: ScheduleTable, state: _State) -> None:
        """Gather the measured steps on pipeline rank 0, decide on global rank 0, broadcast, check, switch."""
        parts: list[Any] = [None] * dist.get_world_size(self.group) if self.pp_rank == 0 else None
        dist.gather_object(state.measured, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        payload: list[Any] = [None]
        if self.rank == 0:
            payload = [self._decision_text(running, parts)]
        dist.broadcast_object_list(payload, src=0)
        decision_dict, table_text, failure = payload[0]
        state.decided_at = state.verify_from = state.steps
        state.measured.clear()
        if failure is not None:
            if self.rank == 0:
                logger.warning("primuspipe auto-replan: no decision (%s); keeping %s", failure, running.algorithm)
            state.failure = failure
            self._write()
            return
        table = ScheduleTable.from_json(table_text, "the re-planned table rank 0 broadcast")
        check_same_table(table, self.rank, dist.group.WORLD)  # every rank of every pipeline holds it
        state.decision = Decision.from_dict(decision_dict, table)
        state.table = table if state.decision.switch else running
        state.verify_from = state.decided_at + state.decision.switch
        self._write()

    def _decision_text(self, running: ScheduleTable, parts: list[list[Timeline]]) -> tuple:
        """On global rank 0: ``(decision dict, table JSON, failure)`` from every pipeline rank's steps."""
        try:
            steps = [merge_rank_timelines([p[i] for p in parts], p0.iteration, f"measured step {p0.iteration}")
                     for i, p0 in enumerate(parts[0])]
            capacity = (torch.cuda.get_device_properties(self.device).total_memory
                        if self.device.type == "cuda" else None)
            decision = decide(steps, running, self.settings, memory_capacity_bytes=capacity)
        except PrimusPipeError as exc:
            return None, None, str(exc)
        logger.info("%s", decision.log_line(self._step_of(running), self.settings.threshold))
        return decision.to_dict(), decision.table.to_json(indent=None), None

    def _step_of(self, running: ScheduleTable) -> int:
        return self._states[running].steps

    def _verify(self, state: _State, timeline: Timeline) -> None:
        """Gather the step's span over the pipeline (wall clock) and log it against the prediction."""
        first = min((e.start for rt in timeline.ranks for e in rt.events), default=0.0)
        last = max((e.end for rt in timeline.ranks for e in rt.events), default=0.0)
        mine = (timeline.meta["t0_unix"] + first, timeline.meta["t0_unix"] + last)
        spans: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(spans, mine, group=self.group)
        measured = max(end for _, end in spans) - min(start for start, _ in spans)
        predicted = state.decision.predicted_step_time
        entry = {"step": state.steps - 1, "measured_step_time_s": measured, "predicted_step_time_s": predicted,
                 "error": prediction_error(measured, predicted)}
        state.verified.append(entry)
        if self.rank == 0:
            logger.info("primuspipe auto-replan: step %d ran %s in %.4g s, predicted %.4g s (error %+.1f%%)",
                        entry["step"], state.table.algorithm, measured, predicted, 100 * entry["error"])
        self._write()

    def _write(self) -> None:
        """``<dump_dir>/replan.json`` on global rank 0 when dumping: every decision and verified step."""
        if self.rank != 0 or self.dump_dir is None:
            return
        records = [self.summary(running) for running in self._states]
        write_atomically(Path(self.dump_dir) / "replan.json",
                         json.dumps([r for r in records if r is not None], indent=1))


def replanner_for(settings: ReplanSettings, group: Any, device: torch.device,
                  dump_dir: str | None) -> InFlightReplanner | None:
    """A replanner when ``settings.enabled``, else None (the backends' one line)."""
    return InFlightReplanner(settings, group, device, dump_dir) if settings.enabled else None
