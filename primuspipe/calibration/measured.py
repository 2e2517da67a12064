"""What calibration measured (:class:`MeasuredCosts`) and the cost file it writes.

Figures are kept to 12 significant digits (:func:`significant`) wherever they are measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from primuspipe.ir.cost_file import merge_fixed, stage_totals


@dataclass(frozen=True)
class MeasuredCosts:
    """Per-model-stage times measured from timelines of one table shape (in ``time_unit``)."""

    algorithm: str
    pp: int
    vpp: int
    microbatches: int
    time_unit: str
    iterations: tuple[int, ...]
    """The iterations the figures come from (warm-up ones excluded)."""
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    """Where the run only had fused BW nodes, B and W are each half of BW (see ``notes``)."""
    fused_backward: tuple[float, ...] | None
    """Measured BW per stage (B + W where a stage had no BW node); None when no stage had one."""
    fb_overlap: float | None
    """From FB nodes: ``(F + B - FB) / min(F, B)`` clamped to [0, 1]; None without FB nodes."""
    p2p_latency: float | None
    """Median transfer time of the transfers a consumer waited for (see the module docstring); None
    without any (the latency part when a bandwidth was fitted)."""
    peak_memory_bytes: tuple[int | None, ...]
    """Per rank, the highest peak over the iterations kept; None where not measured."""
    notes: tuple[str, ...] = ()
    """Assumptions the figures rest on, for people (written into the cost file's header)."""
    cold_start: dict[str, tuple[float, ...]] | None = None
    """Per cost key (``f``, ``b``, ``w``; ``bw`` where a step's first BW paid other than its first B and W
    together) and stage, the extra time of a chunk's first node of that kind in a step; None when none
    was longer."""
    host_overhead: dict[str, float] = field(default_factory=dict)
    """Per compute kind (lower-case name), the host time before each of its nodes."""
    host_post: dict[str, float] = field(default_factory=dict)
    """``send`` / ``recv``: the host time to post one."""
    p2p_bandwidth: float | None = None
    """Bytes per time unit, fitted where messages of several sizes were timed; None otherwise."""
    message_bytes: int | None = None
    """The size of the run's messages (the most common one), where the dump records sizes."""
    cores: float | None = None
    """Cores the ranks shared (``host.cores``); None when each rank had its own."""
    background: float | None = None
    """With ``cores``: the share of a core each rank's process kept busy outside its main thread."""
    contention: float | None = None
    """With ``cores``: extra CPU per unit of work per busy rank beyond the free cores (crowding.py);
    None where the run cannot tell (a core per rank)."""
    step_gap: tuple[float, ...] | None = None
    """Per rank, the time from its step's end to its next step's start (consecutive dumped iterations);
    None where the dump cannot tell."""
    fixed: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Per cost key (``f``, ``b``, ``w``, ``bw``), each stage's time outside the model's layers, where the
    dump timed the layers (``TimedNode.layers``; the cost file's ``compute.fixed``); empty otherwise."""
    chunk: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Likewise, outside the layers and the embedding (``TimedNode.ends``): the fixed cost every chunk
    pays (the cost file's ``compute.chunk``; the last stage's, whose loss is not timed apart, is the
    others' median); empty where not measured."""
    w_warm: tuple[float, ...] | None = None
    """Per stage, the time of a warm W (``backward_weight``: of a cold one); the W of a stage that ran W
    in one context only. None where no stage ran W in both, or both took the same."""
    dropped_runs: tuple[int, ...] = ()
    """Of several runs calibrated together, the indices of those left out as a moment of the host
    (:mod:`~primuspipe.calibration.runs`; ``notes`` says why); empty otherwise."""
    speed: float | None = None
    """With ``cores``: the share of a core a rank's thread got while no other rank of its host was busy
    (``host.speed``, :func:`~primuspipe.calibration.crowding.lone_speed`); None where no rank ran alone or
    it got a whole core."""
    probe_window: tuple[float, ...] | None = None
    """Per rank, how much longer (a share) nodes that opened a probe window took than their kind's others
    (``compute.probe_window``, :func:`~primuspipe.calibration.estimators.window_share`); None where the
    run had no such window or its nodes took no longer."""
    message_cpu: float | None = None
    """With ``cores``: the CPU a rank's process spent outside its main thread per message it sent or received,
    beyond ``background`` (which is then the rest's share of a core); None where the run cannot tell it from
    the step's length (every rank sent and received as many messages: pp = 2 1F1B)."""

    def cost_dict(self, *, per_model_stage: bool = False) -> dict[str, Any]:
        """The cost-file mapping (``CostModel.from_dict``'s YAML form); see the module docstring for
        the 1F1B-stage vs model-stage choice."""
        def values(per_stage: Sequence[float]) -> list[float]:
            if per_model_stage or self.vpp == 1:
                return list(per_stage)
            return [significant(total) for total in stage_totals(per_stage, self.pp)]

        compute: dict[str, Any] = {"f": values(self.forward), "b": values(self.backward_input),
                                   "w": values(self.backward_weight)}
        if self.fused_backward is not None:
            compute["bw"] = values(self.fused_backward)
        if self.fb_overlap is not None:
            compute["fb_overlap"] = self.fb_overlap
        if self.cold_start is not None:
            compute["cold_start"] = {key: values(v) for key, v in self.cold_start.items()}
        if self.fixed:
            written = {key: self._fixed_values(key, per_model_stage) for key in self.fixed}
            compute.update((key, times) for key, (times, _, _) in written.items())  # less the extra chunks' own
            compute["fixed"] = {key: parts for key, (_, parts, _) in written.items()}
            if self.chunk:
                compute["chunk"] = {key: chunk for key, (_, _, chunk) in written.items() if key in self.chunk}
        if self.probe_window is not None:
            compute["probe_window"] = list(self.probe_window)
        if self.w_warm is not None:  # W as written less what running warm saved, on the same stages
            saving = values([w - hot for w, hot in zip(self.backward_weight, self.w_warm)])
            compute["w_warm"] = [significant(max(0.0, w - x)) for w, x in zip(compute["w"], saving)]
        out: dict[str, Any] = {"time_unit": self.time_unit, "compute": compute}
        host: dict[str, Any] = {}
        if any(self.host_overhead.values()):
            host["overhead"] = dict(self.host_overhead)
        host.update((k, v) for k, v in self.host_post.items() if v)
        if self.cores is not None:
            host["cores"] = self.cores
            if self.background:
                host["background"] = self.background
            if self.contention:
                host["contention"] = self.contention
            if self.speed is not None:
                host["speed"] = self.speed
            if self.message_cpu:
                host["message_cpu"] = self.message_cpu
        if self.step_gap is not None:
            host["step_gap"] = list(self.step_gap)
        if host:
            out["host"] = host
        p2p: dict[str, Any] = {}
        if self.message_bytes:
            p2p["message_bytes"] = self.message_bytes
        if self.cores is not None:
            p2p["ranks_per_node"] = self.pp  # the run's ranks shared one host's cores
        if self.p2p_latency or self.p2p_bandwidth:
            link: dict[str, Any] = {"latency": self.p2p_latency or 0.0}
            if self.p2p_bandwidth:
                link["bandwidth"] = self.p2p_bandwidth
            p2p.update(intra_node=dict(link), inter_node=dict(link))
        if p2p:
            out["p2p"] = p2p
        return out

    def _fixed_values(self, key: str, per_model_stage: bool) -> tuple[list[float], list[float], list[float]]:
        """``compute.<key>``, ``compute.fixed.<key>`` and ``compute.chunk.<key>``: per model stage as
        measured, or per 1F1B stage (:func:`merge_fixed`: the ``vpp - 1`` extra chunks' own fixed costs
        are not a 1F1B stage's)."""
        times = self.fused_backward if key == "bw" else {"f": self.forward, "b": self.backward_input,
                                                         "w": self.backward_weight}[key]
        parts = self.fixed[key]
        chunk = self.chunk.get(key, parts)
        if per_model_stage or self.vpp == 1:
            return list(times), list(parts), list(chunk)
        return tuple([significant(x) for x in values] for values in merge_fixed(times, parts, chunk, self.pp))

    def to_yaml(self, *, per_model_stage: bool = False) -> str:
        """A cost file ``primuspipe simulate --cost`` reads, with what was measured in its header
        (peak memory per rank has no field in the format, so it is a comment)."""
        per = ("model stage (pp*vpp values, exact for this shape only)" if per_model_stage and self.vpp > 1
               else "1F1B stage (pp values)")
        memory = ", ".join(f"rank {r}: " + ("not measured" if b is None else f"{b} ({b / 2**30:.3f} GiB)")
                           for r, b in enumerate(self.peak_memory_bytes))
        header = [
            f"primuspipe cost model measured from {self.algorithm} pp={self.pp} vpp={self.vpp} m={self.microbatches}",
            f"iterations used: {', '.join(map(str, self.iterations))} (median of each iteration's mean node time)",
            f"times are per {per}",
            f"measured peak memory per rank: {memory}",
            *self.notes,
        ]
        body = yaml.safe_dump(self.cost_dict(per_model_stage=per_model_stage), sort_keys=False, default_flow_style=None)
        return "".join(f"# {line}\n" for line in header) + body


def significant(x: float) -> float:
    """``x`` to 12 significant digits: drops the float noise of ``end - start`` (1.0 not
    0.9999999999999998) and stays far below any clock's resolution."""
    return float(f"{x:.12g}")


def elapsed(start: float, end: float) -> float:
    """``end - start`` to 12 significant digits of the readings themselves: a short wait between two
    late clock readings (0.05 s at t = 50 s) otherwise keeps their float noise in digits that
    :func:`significant` alone would count as signal (0.0499999999999)."""
    scale = max(abs(start), abs(end))
    return round(end - start, 11 - math.floor(math.log10(scale))) if scale else 0.0
