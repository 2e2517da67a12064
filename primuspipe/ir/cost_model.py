"""The cost model: what each node costs in time and memory, shared by the simulator and the algorithms.

Everything is resolved against one pipeline shape (``num_stages = pp * vpp`` stages, ``pp`` ranks), so
a model is checked once when built and looked up by index while simulating. Times are in
``time_unit`` (``"s"``, ``"ms"`` or ``"us"``); only their ratios matter to step time and bubble rate,
the unit only labels timelines and scales Chrome traces.

YAML form (every section but ``compute`` optional). The file does not know the pipeline shape, so its
per-stage quantities (times, activation bytes) describe *1F1B stages*, the model split ``pp`` ways: a
number is one 1F1B stage's value, a list has one per 1F1B stage (``pp`` values). A schedule with
``vpp`` chunks per rank cuts each 1F1B stage into ``vpp`` model stages, and model stage ``s`` gets
``value[s // vpp] / vpp``; this is what makes algorithms of different ``vpp`` comparable under one
file, and matches the microbatch units of memory (a chunk's activations are ``1/vpp`` of a unit). A
list of ``pp * vpp`` values gives every model stage exactly. Per-rank quantities (parameter, gradient,
optimizer bytes) are one number or ``pp`` values::

    time_unit: ms
    compute:
      f: 1.0                 # forward time of a 1F1B stage (or a list, see above)
      b: 1.0                 # input-grad backward (B)
      w: 1.0                 # weight-grad backward (W)
      bw: 1.8                # fused backward; defaults to b + w
      recompute: 0.4         # any other timed kind, by its KindSpec.cost key (a plug-in's, say)
      fb_overlap: 0.0        # FB pair: F + B - fb_overlap * min(F, B); 0 = no gain, 1 = max(F, B)
      cold_start: {f: 0.3, b: 0.1, w: 0.05}  # extra time of each chunk's first F, B, W in a step
    host:                    # time on the host, outside the kernels (every key optional, default 0)
      overhead: {f: 0.03, b: 0.04, w: 0.02, bw: 0.04}   # rank time before each node of a kind
      send: 0.15             # rank time to post a send (the transfer can start once it is posted)
      recv: 0.10             # rank time to post a receive
      cores: 2               # cores the ranks of one node share; omitted: one per rank (no contention)
      background: 0.05       # with cores: share of a core each rank's process keeps busy off its main thread
      contention: 0.03       # with cores: extra CPU per unit of work for each job beyond the free cores
      step_gap: 3.0          # per rank (one number or pp values): from its step's end to its next step
    p2p:
      message_bytes: 16777216            # one activation (= its gradient) crossing a stage boundary
      ranks_per_node: 8
      intra_node: {latency: 0.005, bandwidth: 4.0e8}   # bandwidth in bytes per time unit
      inter_node: {latency: 0.020, bandwidth: 2.5e7}   # omitted bandwidth: unlimited
    host_link: {latency: 0.01, bandwidth: 2.5e7}   # device <-> host copies (OFFLOAD/RELOAD); default free
    memory:
      w_retained_fraction: 0.94          # share of a microbatch's activations B keeps for W (default 32/34)
      offload_fraction: 1.0              # share of them an OFFLOAD moves to host (default 1: all)
      activation_bytes: 2.0e9            # per 1F1B stage, one microbatch, held from F until released
      parameter_bytes: 1.0e9             # per rank
      gradient_bytes: 1.0e9
      optimizer_bytes: 4.0e9

>>> model = CostModel.per_stage(4, f=1, b=1, w=1)
>>> model.duration(NodeKind.BW, 0), model.p2p.transfer_time(0, 1)
(2.0, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from primuspipe.errors import ConfigError
from primuspipe import strict
from primuspipe.ir.activations import OFFLOAD_FRACTION, W_RETAINED_FRACTION
from primuspipe.ir.costs import ComputeCosts, Values, per_stage_values
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.node import ScheduleNode
from primuspipe.ir.placement import Placement

TIME_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0}
"""Microseconds per time unit (the Chrome trace's unit)."""


@dataclass(frozen=True)
class Link:
    """A point-to-point path: a message of ``n`` bytes takes ``latency + n / bandwidth``."""

    latency: float = 0.0
    bandwidth: float = math.inf
    """Bytes per time unit; ``math.inf`` (the default) makes the size free."""

    def __post_init__(self) -> None:
        if not (0 <= self.latency < math.inf and self.bandwidth > 0):  # NaN fails every comparison
            raise ConfigError(f"a link needs latency >= 0 and bandwidth > 0, got {self}")

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class P2PCost:
    """Cost of moving one stage-boundary tensor between ranks. The default is free communication."""

    message_bytes: float = 0.0
    """Size of one activation (and of its gradient, the same shape) crossing a stage boundary."""
    intra_node: Link = Link()
    inter_node: Link = Link()
    ranks_per_node: int = 8
    """Ranks ``r`` and ``q`` share a node when ``r // ranks_per_node == q // ranks_per_node``."""

    def __post_init__(self) -> None:
        if not (0 <= self.message_bytes < math.inf and self.ranks_per_node >= 1):
            raise ConfigError(f"p2p needs message_bytes >= 0 and ranks_per_node >= 1, got {self}")

    def transfer_time(self, src: int, dst: int) -> float:
        same_node = src // self.ranks_per_node == dst // self.ranks_per_node
        return (self.intra_node if same_node else self.inter_node).time(self.message_bytes)


@dataclass(frozen=True)
class HostCost:
    """Time a rank spends on the host around its nodes, and the cores ranks share (docs/simulator.md).

    The default is a free host: no overheads, a core per rank."""

    overhead: tuple[tuple[str, float], ...] = ()
    """``(kind, time)`` pairs, kinds by lower-case name (``f``, ``b``, ``w``, ``bw``, ``fb``): the rank
    time spent before each node of that kind once its inputs are in (dispatch, taking the inputs,
    bookkeeping); an unnamed kind takes none."""
    send: float = 0.0
    """Rank time to post one send; the transfer can start once both its ends are posted."""
    recv: float = 0.0
    """Rank time to post one receive."""
    cores: float | None = None
    """Cores the ranks of one node (``p2p.ranks_per_node`` of them) share for compute and host work;
    when more ranks are busy than there are cores, they share them evenly (processor sharing, the fluid
    form of an OS time-slicing them). None: every rank has its own (an accelerator per rank)."""
    background: float = 0.0
    """With ``cores``: the share of a core each rank's process keeps busy outside its main thread while
    the step runs (communication threads, runtime threads), taken from its node's cores; e.g. 0.05 of
    2 cores shared by 2 ranks leaves 1.9 for their main threads. Measured, this CPU follows the time a
    step takes rather than its message count, so it is a rate, not a price per message."""
    contention: float = 0.0
    """With ``cores``: while ``n`` jobs (ranks busy with host work or compute) run on ``free`` cores
    (``cores`` less the background), each needs ``1 + contention * (n - free)`` times its work in CPU
    -- what time slicing costs in cache refills -- so work runs that much slower than the CPU it gets.
    0 (the default): a node's work is its CPU time however crowded the cores."""
    step_gap: tuple[float, ...] | None = None
    """Per rank, the time from the end of its step to the start of its next (optimizer, gradient
    synchronisation, the next batch): a rank that finishes early starts the next step early, so in the
    steady state of training ranks enter a step at different times. None: every rank starts every
    step together (as after a step-end synchronisation)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overhead", tuple(sorted(self.overhead)))  # one model, one value
        values = [v for _, v in self.overhead] + [self.send, self.recv, self.background, self.contention,
                                                  *(self.step_gap or ())]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ConfigError(f"host times must be >= 0 and finite, got {self}")
        if self.cores is not None and not (math.isfinite(self.cores) and self.cores > 0):
            raise ConfigError(f"host.cores must be a number > 0 (or omitted), got {self.cores}")

    def before(self, kind: NodeKind) -> float:
        """Rank time before a node of ``kind``."""
        return dict(self.overhead).get(kind.name.lower(), 0.0)

    def post(self, kind: NodeKind) -> float:
        """Rank time to post a node of a communication ``kind``."""
        return self.send if kind.is_send else self.recv


@dataclass(frozen=True)
class MemoryCost:
    """What a rank holds: activations of microbatches in flight, and (optionally) bytes.

    Release rule: F takes a microbatch's activations of its stage; B releases all but
    ``w_retained_fraction`` of them (what the deferred W still needs, the inputs of its GEMMs); W
    releases the rest; a fused BW releases everything. Memory counted this way is what the device
    holds, and it is the one count of every memory figure: ``peak_activations`` (microbatch units),
    the peak bytes, ``--memory-limit``, ``validate --max-in-flight`` and the algorithms' budgets.
    """

    w_retained_fraction: float = W_RETAINED_FRACTION
    """Share of a microbatch's activations that B keeps for W (default 32/34, see
    :data:`~primuspipe.ir.activations.W_RETAINED_FRACTION`)."""
    activation_bytes: tuple[float, ...] | None = None
    """Per stage: one microbatch's activations; None: bytes are not modelled (reported as unknown)."""
    parameter_bytes: tuple[float, ...] = ()
    """Per rank (so are gradient and optimizer bytes); empty: none modelled."""
    gradient_bytes: tuple[float, ...] = ()
    optimizer_bytes: tuple[float, ...] = ()
    offload_fraction: float = OFFLOAD_FRACTION
    """Share of a microbatch's activations on a chunk that an OFFLOAD node moves to host memory (1: all
    the chunk's saved tensors; less when the runner offloads chosen ops only, e.g. the MLP's inputs)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.w_retained_fraction <= 1.0:
            raise ConfigError(f"w_retained_fraction must be in [0, 1], got {self.w_retained_fraction}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ConfigError(f"memory.offload_fraction must be in [0, 1], got {self.offload_fraction}")
        if not (len(self.parameter_bytes) == len(self.gradient_bytes) == len(self.optimizer_bytes)):
            raise ConfigError("parameter, gradient and optimizer bytes need one value per rank each")

    @classmethod
    def per_stage(
        cls, num_stages: int, pp: int, *, activation_bytes: Values, w_retained_fraction: float = W_RETAINED_FRACTION,
        parameter_bytes: Values = 0.0, gradient_bytes: Values = 0.0, optimizer_bytes: Values = 0.0,
        offload_fraction: float = OFFLOAD_FRACTION,
    ) -> MemoryCost:
        return cls(
            float(w_retained_fraction), per_stage_values("activation_bytes", activation_bytes, num_stages, "stages"),
            per_stage_values("parameter_bytes", parameter_bytes, pp, "ranks"),
            per_stage_values("gradient_bytes", gradient_bytes, pp, "ranks"),
            per_stage_values("optimizer_bytes", optimizer_bytes, pp, "ranks"),
            float(offload_fraction),
        )

    @property
    def models_bytes(self) -> bool:
        return self.activation_bytes is not None

    def static_bytes(self, rank: int) -> float:
        if not self.parameter_bytes:
            return 0.0
        return self.parameter_bytes[rank] + self.gradient_bytes[rank] + self.optimizer_bytes[rank]


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
    host_link: Link = Link()
    """The device <-> host path an OFFLOAD or RELOAD copies over (PCIe on a GPU): a copy of ``n`` bytes
    takes ``latency + n / bandwidth`` on the rank's copy stream of its direction, overlapping compute.
    Default free (zero latency, unlimited bandwidth): give it to price offload (docs/offload.md)."""

    def __post_init__(self) -> None:
        n = self.compute.num_stages
        if self.fused_backward is not None and len(self.fused_backward) != n:
            raise ConfigError(f"fused_backward has {len(self.fused_backward)} values for {n} stages")
        if not 0.0 <= self.fb_overlap <= 1.0:
            raise ConfigError(f"fb_overlap must be in [0, 1] (0: F+B, 1: max(F, B)), got {self.fb_overlap}")
        if self.cold_start is not None and self.cold_start.num_stages != n:
            raise ConfigError(f"compute.cold_start has {self.cold_start.num_stages} values for {n} stages")
        if self.memory.models_bytes and len(self.memory.activation_bytes) != n:
            raise ConfigError(f"memory.activation_bytes has {len(self.memory.activation_bytes)} values for {n} stages")
        if self.time_unit not in TIME_UNITS:
            raise ConfigError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {self.time_unit!r}")
        _check_time_range(self)

    @classmethod
    def per_stage(cls, num_stages: int, f: Values, b: Values, w: Values, *, bw: Values | None = None,
                  other: Mapping[str, Values] | None = None, **rest: Any) -> CostModel:
        """Compute times as one value for all stages or one per stage (``other``: other kinds' times by
        cost key, :class:`~primuspipe.ir.costs.ComputeCosts`); ``rest`` are the other fields."""
        fused = None if bw is None else per_stage_values("BW", bw, num_stages, "stages")
        return cls(ComputeCosts.per_stage(num_stages, f, b, w, **(other or {})), fused, **rest)

    @property
    def num_stages(self) -> int:
        return self.compute.num_stages

    def bw_time(self, stage: int) -> float:
        if self.fused_backward is not None:
            return self.fused_backward[stage]
        return self.compute.fused_backward(stage)

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

    def node_time(self, placement: Placement, rank: int, node: ScheduleNode) -> float:
        """Compute time of a node on ``rank`` (0 for communication nodes)."""
        parts = [(kind, placement.stage(rank, chunk)) for kind, _, chunk in node.parts()]
        if len(parts) > 1:
            return self.overlapped_time(parts)
        return self.duration(*parts[0]) if parts else 0.0

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

        def recut(name: str, values: tuple[float, ...]) -> tuple[float, ...]:
            k = len(values) // pp
            return split_stages(name, [sum(values[i * k:(i + 1) * k]) for i in range(pp)], pp, vpp)

        memory = self.memory
        if memory.models_bytes:
            memory = replace(memory, activation_bytes=recut("activation_bytes", memory.activation_bytes))
        def recut_costs(name: str, costs: ComputeCosts) -> ComputeCosts:
            return costs.map(lambda key, times: recut(f"{name}{key.upper()}", times))

        return replace(self, compute=recut_costs("", self.compute),
                       fused_backward=None if self.fused_backward is None else recut("BW", self.fused_backward),
                       cold_start=None if self.cold_start is None else recut_costs("cold_start.", self.cold_start),
                       memory=memory)

    # -- dict / YAML --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, pp: int, vpp: int, source: str = "cost model") -> CostModel:
        """Build from the YAML form (module docstring) for a pipeline of ``pp`` ranks x ``vpp`` chunks;
        every value is checked (:mod:`primuspipe.strict`) and errors name ``source`` and the field."""
        top = strict.keys(data, source, _SECTIONS)
        comp = strict.keys(top.get("compute"), f"{source}: compute", {*cost_keys(), "fb_overlap", "cold_start"},
                           required={"f", "b", "w"})
        p2p = strict.keys(top.get("p2p", {}), f"{source}: p2p",
                          {"message_bytes", "ranks_per_node", "intra_node", "inter_node"})
        links = {k: strict.keys(p2p.get(k, {}), f"{source}: p2p.{k}", {"latency", "bandwidth"})
                 for k in ("intra_node", "inter_node")}

        def stages(name: str, value: Values) -> tuple[float, ...]:
            return split_stages(f"{source}: {name}", value, pp, vpp)

        def number(section: Mapping[str, Any], key: str, name: str, default: float, **bounds: float) -> float:
            return strict.number(section.get(key, default), f"{source}: {name}", **bounds)

        try:
            memory = _memory(top.get("memory", {}), pp, vpp, source)
            other = {key: stages(key.upper(), comp[key]) for key in sorted(set(comp) - _COMPUTE_FIELDS)}
            return cls.per_stage(
                pp * vpp, stages("F", comp["f"]), stages("B", comp["b"]), stages("W", comp["w"]), other=other,
                bw=None if comp.get("bw") is None else stages("BW", comp["bw"]),
                fb_overlap=number(comp, "fb_overlap", "compute.fb_overlap", 0.0, minimum=0, maximum=1),
                p2p=P2PCost(number(p2p, "message_bytes", "p2p.message_bytes", 0.0, minimum=0),
                            ranks_per_node=strict.count(p2p.get("ranks_per_node", 8), f"{source}: p2p.ranks_per_node",
                                                        minimum=1),
                            **{k: _link(v, f"{source}: p2p.{k}") for k, v in links.items()}),
                memory=memory, time_unit=strict.text(top.get("time_unit", "ms"), f"{source}: time_unit",
                                                     choices=TIME_UNITS),
                host=_host(top.get("host", {}), pp), cold_start=_cold_start(comp.get("cold_start"), pp, vpp),
                host_link=_link(strict.keys(top.get("host_link", {}), f"{source}: host_link",
                                            {"latency", "bandwidth"}), f"{source}: host_link"),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad value in the cost model: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path, *, pp: int, vpp: int) -> CostModel:
        return cls.from_dict(read_cost_file(path), pp=pp, vpp=vpp)

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
        if self.cold_start is not None:
            c = self.cold_start
            out["compute"]["cold_start"] = {key: list(times) for key, times in c.times.items()}
        if self.host != HostCost():
            h = self.host
            out["host"] = {"overhead": dict(h.overhead), "send": h.send, "recv": h.recv, "cores": h.cores,
                           "background": h.background, "contention": h.contention,
                           "step_gap": None if h.step_gap is None else list(h.step_gap)}
        m = self.memory
        out["memory"] = {"w_retained_fraction": m.w_retained_fraction, "offload_fraction": m.offload_fraction}
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


def _check_time_range(model: CostModel) -> None:
    """Finite inputs can still add up to infinity or lose each other in a sum: every time the model
    gives (compute, cold start, host, links and their transfer of ``message_bytes``) is refused above
    :data:`MAX_TIME` or more than :data:`MAX_TIME_RATIO` away from another non-zero one."""
    def per_stage(name: str, costs: ComputeCosts | None) -> dict[str, float]:
        if costs is None:
            return {}
        return {f"{name}{key.upper()}[{s}]": t for key, values in costs.times.items() for s, t in enumerate(values)}

    def link(name: str, k: Link, size: float) -> dict[str, float]:
        return {f"{name}.latency": k.latency, f"{name} transfer of {size:g} bytes": k.time(size) - k.latency}

    times = {**per_stage("compute ", model.compute), **per_stage("cold_start ", model.cold_start),
             **{f"compute BW[{s}]": t for s, t in enumerate(model.fused_backward or ())},
             **{f"host.overhead.{k}": t for k, t in model.host.overhead},
             "host.send": model.host.send, "host.recv": model.host.recv,
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


def split_stages(name: str, value: Values, pp: int, vpp: int) -> tuple[float, ...]:
    """Per-model-stage values from 1F1B-stage values (module docstring): model stage ``s`` gets
    ``value[s // vpp] / vpp``; a list of ``pp * vpp`` values is taken as is.

    >>> split_stages("F", [2, 4], pp=2, vpp=2)
    (1.0, 1.0, 2.0, 2.0)
    """
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) == pp * vpp:
            return per_stage_values(name, value, pp * vpp, "stages")
        if len(value) != pp:
            raise ConfigError(f"{name} has {len(value)} values; give one number, {pp} (one per 1F1B stage) or "
                              f"{pp * vpp} (one per model stage at pp={pp}, vpp={vpp})")
    per_1f1b_stage = per_stage_values(name, value, pp, "1F1B stages")
    return tuple(per_1f1b_stage[s // vpp] / vpp for s in range(pp * vpp))


def read_cost_file(path: str | Path) -> dict[str, Any]:
    """The raw YAML mapping of a cost file (resolve it per shape with :meth:`CostModel.from_dict`)."""
    data = strict.load_yaml(strict.read_text(path, "cost model"), f"cost model {path}")
    return strict.keys(data, f"cost model {path}", _SECTIONS)


def _memory(data: Any, pp: int, vpp: int, source: str) -> MemoryCost:
    """The ``memory`` section: the retained share alone (default :data:`W_RETAINED_FRACTION`), or bytes,
    which then must say what W keeps (the byte figures depend on it)."""
    mem = strict.keys(data, f"{source}: memory", {"activation_bytes", "w_retained_fraction", "parameter_bytes",
                                                  "gradient_bytes", "optimizer_bytes", "offload_fraction"})
    retained = strict.number(mem.get("w_retained_fraction", W_RETAINED_FRACTION),
                             f"{source}: memory.w_retained_fraction", minimum=0, maximum=1)
    offload = strict.number(mem.get("offload_fraction", OFFLOAD_FRACTION), f"{source}: memory.offload_fraction",
                            minimum=0, maximum=1)
    if "activation_bytes" not in mem:
        if set(mem) - {"w_retained_fraction", "offload_fraction"}:
            raise ConfigError(f"{source}: memory: parameter, gradient and optimizer bytes need activation_bytes too")
        return MemoryCost(retained, offload_fraction=offload)
    if "w_retained_fraction" not in mem:
        raise ConfigError(f"{source}: memory lacks ['w_retained_fraction']: with activation_bytes, say what share of "
                          f"them B keeps for W (e.g. {W_RETAINED_FRACTION:.3f} with flash attention, see docs/simulator.md)")
    mem["w_retained_fraction"], mem["offload_fraction"] = retained, offload
    mem["activation_bytes"] = split_stages(f"{source}: memory.activation_bytes", mem["activation_bytes"], pp, vpp)
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        mem[key] = per_stage_values(f"{source}: memory.{key}", mem.get(key, 0.0), pp, "ranks")
    return MemoryCost.per_stage(pp * vpp, pp, **mem)


def _link(data: Mapping[str, Any], name: str) -> Link:
    """A link's YAML form; a missing or null bandwidth is unlimited (infinity itself is refused)."""
    latency = strict.number(data.get("latency", 0.0), f"{name}.latency", minimum=0)
    if data.get("bandwidth") is None:
        return Link(latency)
    bandwidth = strict.number(data["bandwidth"], f"{name}.bandwidth")
    if bandwidth <= 0:
        raise ConfigError(f"{name}: a link needs bandwidth > 0 (bytes per time unit; null or no key for unlimited), "
                          f"got {bandwidth:g}")
    return Link(latency, bandwidth)


_SECTIONS = {"time_unit", "compute", "host", "p2p", "memory", "host_link"}
_COMPUTE_FIELDS = {"f", "b", "w", "bw", "fb_overlap", "cold_start"}
"""The ``compute`` keys the model reads itself; any other is a timed kind's cost key."""


def cost_keys() -> set[str]:
    """The cost keys of every timed kind in the kind table (``f``, ``b``, ``w``, ``bw`` and any a
    plug-in kind names): what a cost file's ``compute`` section may time."""
    return {k.spec.cost for k in compute_kinds() if k.spec.cost is not None}


def _host(data: Any, pp: int) -> HostCost:
    host = strict.keys(data, "host", {"overhead", "send", "recv", "cores", "background", "contention", "step_gap"})
    overhead = strict.keys(host.get("overhead", {}), "host.overhead", {k.name.lower() for k in compute_kinds()})
    cores, gap = host.get("cores"), host.get("step_gap")

    def time(value: Any, name: str) -> float:  # strictly a number: YAML's true is not 1 second
        return strict.number(value, f"host.{name} (a time >= 0)", minimum=0)

    return HostCost(tuple((k, time(v, f"overhead.{k}")) for k, v in overhead.items()),
                    time(host.get("send", 0.0), "send"), time(host.get("recv", 0.0), "recv"),
                    None if cores is None else strict.number(cores, "host.cores (a number of cores > 0)", above=0),
                    strict.number(host.get("background", 0.0), "host.background (a share of a core >= 0)", minimum=0),
                    strict.number(host.get("contention", 0.0), "host.contention (a share >= 0)", minimum=0),
                    None if gap is None else per_stage_values("host.step_gap", gap, pp, "ranks"))


def _cold_start(data: Any, pp: int, vpp: int) -> ComputeCosts | None:
    """``compute.cold_start`` per model stage: like the times, per 1F1B stage and split among its chunks."""
    if data is None:
        return None
    cold = strict.keys(data, "compute.cold_start", cost_keys() - {"bw"})

    def times(key: str) -> tuple[float, ...]:
        return split_stages(f"compute.cold_start.{key}", cold.get(key, 0.0), pp, vpp)

    return ComputeCosts(times("f"), times("b"), times("w"), tuple((k, times(k)) for k in set(cold) - {"f", "b", "w"}))
