"""The cost model: what each node costs in time and memory, shared by the simulator and the algorithms.

Everything is resolved against one pipeline shape (``num_stages = pp * vpp`` stages, ``pp`` ranks), so
a model is checked once when built and looked up by index while simulating. Times are in
``time_unit`` (``"s"``, ``"ms"`` or ``"us"``); only their ratios matter to step time and bubble rate,
the unit only labels timelines and scales Chrome traces. The YAML form is :mod:`primuspipe.ir.cost_file`'s,
read into a model by :mod:`primuspipe.ir.cost_reader`; the parts besides compute times are
:mod:`primuspipe.ir.cost_parts`'; which node of a row runs a warm W or opens a window is
:mod:`primuspipe.ir.row_context`'s to say, this model's to price.

>>> model = CostModel.per_stage(4, f=1, b=1, w=1)
>>> model.duration(NodeKind.BW, 0), model.p2p.transfer_time(0, 1)
(2.0, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from primuspipe.errors import ConfigError
from primuspipe import strict
from primuspipe.ir.cost_file import (merge_fixed, read_cost_file, split_fixed, split_stages, stage_totals,
                                     warm_stages)
from primuspipe.ir.cost_parts import TIME_UNITS, HostCost, LateWork, Link, MemoryCost, P2PCost
from primuspipe.ir.cost_reader import read_model
from primuspipe.ir.costs import ComputeCosts, Values, per_stage_values
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.limits import check_shape
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.row_context import warm_weight_grad
from primuspipe.ir.placement import Placement


@dataclass(frozen=True)
class CostModel:
    """Time and memory of every node of a table with ``compute.num_stages`` stages."""

    compute: ComputeCosts
    fused_backward: tuple[float, ...] | None = None
    """BW time per stage; None means B + W (no gain from fusing)."""
    fb_overlap: float = 0.0
    """An FB node (F overlapped with another microbatch's B) costs ``F + B - fb_overlap * min(F, B)``."""
    p2p: P2PCost = P2PCost()
    host: HostCost = HostCost()
    cold_start: ComputeCosts | None = None
    """Per stage, the extra time of each chunk's first F, B and W node in a step (BW: B + W) -- caches,
    allocator and lazily built state are cold then; None: none."""
    memory: MemoryCost = MemoryCost()
    """What W keeps of B's activations (always) and bytes (when modelled)."""
    time_unit: str = "ms"
    fixed: tuple[tuple[str, tuple[float, ...], tuple[float, ...]], ...] = ()
    """Per cost key (``f``, ``b``, ``w``, ``bw``...): the part of each stage's time spent outside the
    model's layers and the fixed cost its chunk pays of it (``compute.fixed`` and ``compute.chunk``,
    :func:`~primuspipe.ir.cost_file.split_fixed`); empty where not measured. Only :meth:`for_shape`
    reads it: cutting the model for another ``vpp`` then charges every chunk its own fixed cost instead
    of an even share."""
    host_link: Link = Link()
    """The device <-> host path an OFFLOAD or RELOAD copies over (PCIe on a GPU): a copy of ``n`` bytes
    takes ``latency + n / bandwidth`` on the rank's copy stream of its direction, overlapping compute.
    Default free (zero latency, unlimited bandwidth): give it to price offload (docs/offload.md)."""
    w_warm: tuple[float, ...] | None = None
    """Per stage, the time of a *warm* W (:func:`~primuspipe.ir.row_context.warm_weight_grad`: run right after
    its own B or another W of its chunk, what it reads still in cache), where ``compute`` W is what a cold one
    takes (after a forward or another microbatch's B); None: W costs the same wherever it runs. Only :meth:`node_time`
    (the simulator) reads it: the algorithms plan with :meth:`duration`, the cold W, and are judged by
    simulating."""
    probe_window: float | tuple[float, ...] = 0.0
    """The share of extra time the node takes that opens a window, the first to run while its rank holds
    a deferred W's inputs (:func:`~primuspipe.ir.row_context.window_openings`), F, B or BW alike, per rank (one
    number: every rank's); 0: none. The split probe opens such windows in a fused-backward step
    (:func:`~primuspipe.ir.row_context.probe_windows`), where calibration measures it per rank; a
    split-backward schedule's rank that defers a W pays its rank's share where its window opens, once however long the W stays pending (docs/simulator.md). Only
    :meth:`node_time` (the simulator) reads it."""
    late_w: LateWork | None = None
    """Time one stage's W (or BW) takes more from some microbatch on (:class:`~primuspipe.ir.cost_parts.LateWork`:
    megatron-core's partial deferral of the output layer's weight gradients); None: none. The one cost that
    depends on a node's microbatch: only :meth:`node_time` (the simulator) reads it, the algorithms plan with
    :meth:`duration`, the time without it, and are judged by simulating."""
    source: str = field(default="", compare=False)
    """Where the costs came from (a cost file's path, :meth:`from_dict`'s ``source``), for the simulator's
    messages about them; empty when built in code."""

    def __post_init__(self) -> None:
        strict.fields(self)
        n = self.compute.num_stages
        for name in ("fused_backward", "w_warm"):  # a file's are read by per_stage_values; code's are checked here
            if (values := getattr(self, name)) is not None:
                object.__setattr__(self, name, per_stage_values(f"CostModel.{name}", values, n))
        if not 0.0 <= self.fb_overlap <= 1.0:
            raise ConfigError(f"fb_overlap must be in [0, 1] (0: F+B, 1: max(F, B)), got {self.fb_overlap}")
        if self.cold_start is not None and self.cold_start.num_stages != n:
            raise ConfigError(f"compute.cold_start has {self.cold_start.num_stages} values for {n} stages")
        if self.memory.models_bytes and len(self.memory.activation_bytes) != n:
            raise ConfigError(f"memory.activation_bytes has {len(self.memory.activation_bytes)} values for {n} stages")
        for key, parts, chunk in self.fixed:
            if len(parts) != n or len(chunk) != n:
                raise ConfigError(f"compute.fixed.{key} / compute.chunk.{key} have {len(parts)} / {len(chunk)} values "
                                  f"for {n} stages")
        shares = self.probe_window if isinstance(self.probe_window, tuple) else (self.probe_window,)
        if not all(math.isfinite(x) and x >= 0 for x in shares):
            raise ConfigError(f"compute.probe_window must be finite shares >= 0 (0.1: 10 % longer), got "
                              f"{self.probe_window}")
        if isinstance(self.probe_window, tuple) and (not shares or n % len(shares)):
            raise ConfigError(f"compute.probe_window has {len(shares)} values, not one per rank of {n} stages")
        if self.late_w is not None and self.late_w.stage >= n:
            raise ConfigError(f"compute.late_w.stage {self.late_w.stage} is not one of the {n} stages")
        if self.time_unit not in TIME_UNITS:
            raise ConfigError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {self.time_unit!r}")
        _check_time_range(self)

    @classmethod
    def per_stage(cls, num_stages: int, f: Values, b: Values, w: Values, *, bw: Values | None = None,
                  other: Mapping[str, Values] | None = None, w_warm: Values | None = None, **rest: Any) -> CostModel:
        """Compute times as one value for all stages or one per stage (``other``: other kinds' times by
        cost key, :class:`~primuspipe.ir.costs.ComputeCosts`; ``w_warm``: :attr:`w_warm`);
        ``rest`` are the other fields."""
        fused = None if bw is None else per_stage_values("BW", bw, num_stages, "stages")
        warm = None if w_warm is None else per_stage_values("compute.w_warm", w_warm, num_stages, "stages")
        return cls(ComputeCosts.per_stage(num_stages, f, b, w, **(other or {})), fused, w_warm=warm, **rest)

    @property
    def num_stages(self) -> int:
        return self.compute.num_stages

    def duration(self, kind: NodeKind, stage: int) -> float:
        """Time of one compute part of ``kind`` on ``stage``: the per-stage time the kind table names
        (:attr:`~primuspipe.ir.kinds.KindSpec.cost`); a kind that names none takes no time."""
        key = kind.spec.cost
        if key is None:
            return 0.0
        if key == "bw" and self.fused_backward is not None:  # measured fused; else the costs' B + W
            return self.fused_backward[stage]
        return self.compute.of(kind)[stage]

    def overlapped_time(self, parts: Sequence[tuple[NodeKind, int]]) -> float:
        """Time of an overlapped node (FB) running ``(kind, stage)`` parts together: their sum less
        ``fb_overlap`` times the shorter one (0: no gain, 1: the longer part alone)."""
        times = [self.duration(kind, stage) for kind, stage in parts]
        return sum(times) - self.fb_overlap * min(times)

    def node_time(self, placement: Placement, rank: int, node: ScheduleNode,
                  previous: ScheduleNode | None = None, window: bool = False) -> float:
        """Compute time of a node on ``rank`` (0 for communication nodes); ``previous`` is the compute
        node the rank ran just before it (None: none), which sets what a W costs (:attr:`w_warm`);
        ``window``: the node opens a window (:func:`~primuspipe.ir.row_context.window_openings`), which
        :attr:`probe_window` prices."""
        parts = [(kind, placement.stage(rank, chunk)) for kind, _, chunk in node.parts()]
        if len(parts) > 1:
            time = self.overlapped_time(parts)
        elif self.w_warm is not None and warm_weight_grad(previous, node):
            time = self.w_warm[parts[0][1]]
        else:
            time = self.duration(*parts[0]) if parts else 0.0
        time += self.late_time(placement, rank, node)
        return time * (1 + self.window_share(rank)) if window else time

    def late_time(self, placement: Placement, rank: int, node: ScheduleNode) -> float:
        """What :attr:`late_w` adds to ``node`` on ``rank`` (0 without it)."""
        if self.late_w is None:
            return 0.0
        return self.late_w.time_in([(kind, mb, placement.stage(rank, chunk)) for kind, mb, chunk in node.parts()])

    def window_share(self, rank: int) -> float:
        """:attr:`probe_window` of ``rank``."""
        return self.probe_window[rank] if isinstance(self.probe_window, tuple) else self.probe_window

    @property
    def prices_windows(self) -> bool:
        """Whether any rank pays a share in a window (:attr:`probe_window`)."""
        return any(self.probe_window) if isinstance(self.probe_window, tuple) else self.probe_window > 0

    def cold_start_time(self, parts: Sequence[tuple[NodeKind, int]]) -> float:
        """Extra time of a node whose ``(kind, stage)`` parts are their chunks' first of that kind."""
        if self.cold_start is None:
            return 0.0
        extra = [(self.cold_start.get(kind), stage) for kind, stage in parts if kind.spec.cost is not None]
        return sum(times[stage] for times, stage in extra if times is not None)  # an untimed key: none

    def static_bytes(self, rank: int) -> float:
        return self.memory.static_bytes(rank)

    def offload_bytes(self, stage: int) -> float:
        """What one OFFLOAD (or RELOAD) of ``stage`` moves: its microbatch's activations times
        ``memory.offload_fraction`` (0 when bytes are not modelled)."""
        m = self.memory
        return m.activation_bytes[stage] * m.offload_fraction if m.models_bytes else 0.0

    def copy_time(self, stage: int) -> float:
        """Time of one OFFLOAD or RELOAD of ``stage`` on the host link."""
        return self.host_link.time(self.offload_bytes(stage))

    def for_shape(self, pp: int, vpp: int) -> CostModel:
        """The same model cut into ``pp * vpp`` stages: each 1F1B stage (``num_stages // pp`` consecutive
        model stages) keeps its total time and activation bytes, split evenly over its ``vpp`` new
        stages (as the YAML form splits a 1F1B stage's value). A search that compares placements of
        different ``vpp`` (``zb-auto``) times each under this one model."""
        if self.num_stages == pp * vpp:
            return self
        if pp < 1 or vpp < 1 or self.num_stages % pp:
            raise ConfigError(f"a cost model of {self.num_stages} stages cannot be cut for pp={pp}, vpp={vpp}")
        check_shape(pp, vpp, 1)

        def recut(name: str, values: tuple[float, ...]) -> tuple[float, ...]:
            return split_stages(name, stage_totals(values, pp), pp, vpp)

        cut: dict[str, tuple[tuple[float, ...], ...]] = {}  # key -> (times, fixed parts, chunks' own)
        for key, parts, chunk in self.fixed:
            times = self.fused_backward if key == "bw" else self.compute.times.get(key)
            if times is not None:
                total, own, each = merge_fixed(times, parts, chunk, pp)
                cut[key] = split_fixed(f"compute.{key}", total, own, pp, vpp, f"compute.fixed.{key}", each)

        def recut_key(name: str, key: str, times: tuple[float, ...]) -> tuple[float, ...]:
            return cut[key][0] if key in cut else recut(f"{name}{key.upper()}", times)

        memory = self.memory
        if memory.models_bytes:
            memory = replace(memory, activation_bytes=recut("activation_bytes", memory.activation_bytes))
        def recut_costs(name: str, costs: ComputeCosts) -> ComputeCosts:
            return costs.map(lambda key, times: recut(f"{name}{key.upper()}", times))

        compute = self.compute.map(lambda key, times: recut_key("", key, times))
        warm = None
        if self.w_warm is not None:  # each 1F1B stage keeps what running W warm saves on it
            saving = [w - hot for w, hot in zip(self.compute.backward_weight, self.w_warm)]
            warm = warm_stages(compute.backward_weight, stage_totals(saving, pp))
        late = None  # on the new stage that holds the end of the old one (the output layer ends the last)
        if self.late_w is not None:
            late = replace(self.late_w, stage=-(-(self.late_w.stage + 1) * pp * vpp // self.num_stages) - 1)
        return replace(self, compute=compute, w_warm=warm, late_w=late,
                       fused_backward=None if self.fused_backward is None else recut_key("", "bw", self.fused_backward),
                       cold_start=None if self.cold_start is None else recut_costs("cold_start.", self.cold_start),
                       memory=memory, fixed=tuple((key, parts, chunk) for key, (_, parts, chunk) in cut.items()))

    # -- dict / YAML --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, pp: int, vpp: int, source: str = "cost model") -> CostModel:
        """Build from the YAML form (:mod:`~primuspipe.ir.cost_file`) for a pipeline of ``pp`` ranks x ``vpp`` chunks
        (:func:`~primuspipe.ir.cost_reader.read_model`); every value is checked (:mod:`primuspipe.strict`) and errors
        name ``source`` and the field."""
        model = read_model(cls.per_stage, data, pp=pp, vpp=vpp, source=source)
        model.check_cores(pp)
        return model

    def check_cores(self, pp: int) -> None:
        """Refuse a ``host.background`` that leaves no core free for the ranks of one node of a ``pp``-rank
        pipeline: the same for every algorithm (``host.message_cpu``, which depends on each table's messages,
        is the simulator's to check), so it is refused once, naming the file, before any table is built."""
        host, ranks = self.host, min(pp, self.p2p.ranks_per_node)
        if host.cores is not None and host.background * ranks >= host.cores:
            raise ConfigError(f"{self.source or 'cost model'}: host.background ({host.background:g} of a core per "
                              f"rank) leaves no core free on a node of {ranks} ranks sharing host.cores "
                              f"({host.cores:g}); lower host.background below {host.cores / ranks:g} or raise "
                              "host.cores")

    @classmethod
    def load(cls, path: str | Path, *, pp: int, vpp: int) -> CostModel:
        return cls.from_dict(read_cost_file(path), pp=pp, vpp=vpp, source=f"cost model {path}")

    def to_dict(self) -> dict[str, Any]:
        """The YAML form with one value per model stage; unlimited bandwidth is written as None."""
        def link(k: Link) -> dict:
            return {"latency": k.latency, "bandwidth": None if math.isinf(k.bandwidth) else k.bandwidth}

        out: dict[str, Any] = {
            "time_unit": self.time_unit,
            "compute": {**{key: list(times) for key, times in self.compute.times.items()}, "fb_overlap": self.fb_overlap},
            "p2p": {"message_bytes": self.p2p.message_bytes, "ranks_per_node": self.p2p.ranks_per_node,
                    "intra_node": link(self.p2p.intra_node), "inter_node": link(self.p2p.inter_node)},
            "host_link": link(self.host_link),
        }
        if self.fused_backward is not None:
            out["compute"]["bw"] = list(self.fused_backward)
        if self.w_warm is not None:
            out["compute"]["w_warm"] = list(self.w_warm)
        if self.late_w is not None:
            late = self.late_w
            out["compute"]["late_w"] = {"stage": late.stage, "first": late.first, "time": late.time}
        if self.prices_windows:
            shares = self.probe_window
            out["compute"]["probe_window"] = list(shares) if isinstance(shares, tuple) else shares
        if self.cold_start is not None:
            c = self.cold_start
            out["compute"]["cold_start"] = {key: list(times) for key, times in c.times.items()}
        if self.fixed:
            out["compute"]["fixed"] = {key: list(parts) for key, parts, _ in self.fixed}
            out["compute"]["chunk"] = {key: list(chunk) for key, _, chunk in self.fixed}
        if self.host != HostCost():
            h = self.host
            out["host"] = {"overhead": dict(h.overhead), "send": h.send, "recv": h.recv, "cores": h.cores,
                           "background": h.background, "contention": h.contention, "speed": h.speed,
                           "message_cpu": h.message_cpu,
                           "step_gap": None if h.step_gap is None else list(h.step_gap)}
        m = self.memory
        out["memory"] = {"w_retained_fraction": m.w_retained_fraction, "offload_fraction": m.offload_fraction,
                         "b_rise_fraction": m.b_rise_fraction, "w_excess_fraction": m.w_excess_fraction}
        if m.models_bytes:
            out["memory"].update(activation_bytes=list(m.activation_bytes), parameter_bytes=list(m.parameter_bytes),
                                 gradient_bytes=list(m.gradient_bytes), optimizer_bytes=list(m.optimizer_bytes))
        return out



MAX_TIME = 1e12
"""Largest time (in any unit) a cost model may give: a step adds up millions of them and must stay a
float far from overflow."""
MAX_TIME_RATIO = 1e9
"""Largest ratio between two non-zero times of one cost model: a float sum keeps about 16 digits, so
beyond that a step's running time swallows the shorter nodes entirely (1e300 + 1 == 1e300) and a
planner waiting for one to pass never ends."""


def negligible(x: float, beside: float) -> float:
    """``x``, or 0 where it is more than :data:`MAX_TIME_RATIO` times smaller than ``beside`` (the longest
    time): no float sum with that time keeps it, and the cost model refuses such a pair, so it is no time --
    the float noise of two clock readings that agree (a transfer that arrived as it was posted: 1.5e-13 s
    beside 9 ms nodes), or a 5 us link latency beside the hours a projected 1 GFLOP/s host computes for.

    >>> negligible(1.5e-13, 0.009), negligible(2e-6, 0.009)
    (0.0, 2e-06)
    """
    return 0.0 if x * MAX_TIME_RATIO < beside else x


def _check_time_range(model: CostModel) -> None:
    """Finite inputs can still add up to infinity or lose each other in a sum: every time the model
    gives (compute, cold start, late work, host, links and their transfer of ``message_bytes``) is refused above
    :data:`MAX_TIME` or more than :data:`MAX_TIME_RATIO` away from another non-zero one."""
    def per_stage(name: str, costs: ComputeCosts | None) -> dict[str, float]:
        if costs is None:
            return {}
        return {f"{name}{key.upper()}[{s}]": t for key, values in costs.times.items() for s, t in enumerate(values)}

    def link(name: str, k: Link, size: float) -> dict[str, float]:
        return {f"{name}.latency": k.latency, f"{name} transfer of {size:g} bytes": k.time(size) - k.latency}

    times = {**per_stage("compute ", model.compute), **per_stage("cold_start ", model.cold_start),
             **{f"compute BW[{s}]": t for s, t in enumerate(model.fused_backward or ())},
             **{f"compute.w_warm[{s}]": t for s, t in enumerate(model.w_warm or ())},
             **({"compute.late_w.time": model.late_w.time} if model.late_w is not None else {}),
             **{f"host.overhead.{k}": t for k, t in model.host.overhead},
             "host.send": model.host.send, "host.recv": model.host.recv, "host.message_cpu": model.host.message_cpu,
             **{f"host.step_gap[{r}]": t for r, t in enumerate(model.host.step_gap or ())},
             **link("p2p.intra_node", model.p2p.intra_node, model.p2p.message_bytes),
             **link("p2p.inter_node", model.p2p.inter_node, model.p2p.message_bytes),
             **link("host_link", model.host_link, max(model.memory.activation_bytes or (0.0,)))}
    times = {name: t for name, t in times.items() if t > 0}
    if not times:
        return
    big, small = max(times, key=times.get), min(times, key=times.get)
    if not times[big] <= MAX_TIME:
        shown = f"= {times[big]:g} {model.time_unit}" if math.isfinite(times[big]) else "overflows a float and"
        raise ConfigError(f"{big} {shown} is larger than {MAX_TIME:g}, too large for a step's sum to stay a "
                          "number; use a larger time_unit or check the value")
    if times[big] / times[small] > MAX_TIME_RATIO:
        raise ConfigError(f"{small} = {times[small]:g} and {big} = {times[big]:g} {model.time_unit} lie more than "
                          f"{MAX_TIME_RATIO:g} apart, beyond what a sum of them keeps; give 0 for what takes no "
                          "time, or check the values")
