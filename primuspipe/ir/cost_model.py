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
      fb_overlap: 0.0        # FB pair: F + B - fb_overlap * min(F, B); 0 = no gain, 1 = max(F, B)
    p2p:
      message_bytes: 16777216            # one activation (= its gradient) crossing a stage boundary
      ranks_per_node: 8
      intra_node: {latency: 0.005, bandwidth: 4.0e8}   # bandwidth in bytes per time unit
      inter_node: {latency: 0.020, bandwidth: 2.5e7}   # omitted bandwidth: unlimited
    memory:
      w_retained_fraction: 0.94          # share of a microbatch's activations B keeps for W (default 32/34)
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
from primuspipe.ir import strict
from primuspipe.ir.activations import W_RETAINED_FRACTION
from primuspipe.ir.costs import ComputeCosts, Values, per_stage_values
from primuspipe.ir.kinds import NodeKind
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

    def __post_init__(self) -> None:
        if not 0.0 <= self.w_retained_fraction <= 1.0:
            raise ConfigError(f"w_retained_fraction must be in [0, 1], got {self.w_retained_fraction}")
        if not (len(self.parameter_bytes) == len(self.gradient_bytes) == len(self.optimizer_bytes)):
            raise ConfigError("parameter, gradient and optimizer bytes need one value per rank each")

    @classmethod
    def per_stage(
        cls, num_stages: int, pp: int, *, activation_bytes: Values, w_retained_fraction: float = W_RETAINED_FRACTION,
        parameter_bytes: Values = 0.0, gradient_bytes: Values = 0.0, optimizer_bytes: Values = 0.0,
    ) -> MemoryCost:
        return cls(
            float(w_retained_fraction), per_stage_values("activation_bytes", activation_bytes, num_stages, "stages"),
            per_stage_values("parameter_bytes", parameter_bytes, pp, "ranks"),
            per_stage_values("gradient_bytes", gradient_bytes, pp, "ranks"),
            per_stage_values("optimizer_bytes", optimizer_bytes, pp, "ranks"),
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
    memory: MemoryCost = MemoryCost()
    """What W keeps of B's activations (always) and bytes (when modelled)."""
    time_unit: str = "ms"

    def __post_init__(self) -> None:
        n = self.compute.num_stages
        if self.fused_backward is not None and len(self.fused_backward) != n:
            raise ConfigError(f"fused_backward has {len(self.fused_backward)} values for {n} stages")
        if not 0.0 <= self.fb_overlap <= 1.0:
            raise ConfigError(f"fb_overlap must be in [0, 1] (0: F+B, 1: max(F, B)), got {self.fb_overlap}")
        if self.memory.models_bytes and len(self.memory.activation_bytes) != n:
            raise ConfigError(f"memory.activation_bytes has {len(self.memory.activation_bytes)} values for {n} stages")
        if self.time_unit not in TIME_UNITS:
            raise ConfigError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {self.time_unit!r}")

    @classmethod
    def per_stage(cls, num_stages: int, f: Values, b: Values, w: Values, *, bw: Values | None = None,
                  **rest: Any) -> CostModel:
        """Compute times as one value for all stages or one per stage; ``rest`` are the other fields."""
        fused = None if bw is None else per_stage_values("BW", bw, num_stages, "stages")
        return cls(ComputeCosts.per_stage(num_stages, f, b, w), fused, **rest)

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
        if key == "bw":
            return self.bw_time(stage)
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

    def static_bytes(self, rank: int) -> float:
        return self.memory.static_bytes(rank)

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

        c = self.compute
        memory = self.memory
        if memory.models_bytes:
            memory = replace(memory, activation_bytes=recut("activation_bytes", memory.activation_bytes))
        return replace(self, compute=ComputeCosts(recut("F", c.forward), recut("B", c.backward_input),
                                                  recut("W", c.backward_weight)),
                       fused_backward=None if self.fused_backward is None else recut("BW", self.fused_backward),
                       memory=memory)

    # -- dict / YAML --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, pp: int, vpp: int, source: str = "cost model") -> CostModel:
        """Build from the YAML form (module docstring) for a pipeline of ``pp`` ranks x ``vpp`` chunks;
        every value is checked (:mod:`primuspipe.ir.strict`) and errors name ``source`` and the field."""
        top = _section(data, source, {"time_unit", "compute", "p2p", "memory"})
        comp = _section(top.get("compute"), f"{source}: compute", {"f", "b", "w", "bw", "fb_overlap"},
                        required={"f", "b", "w"})
        p2p = _section(top.get("p2p", {}), f"{source}: p2p", {"message_bytes", "ranks_per_node", "intra_node", "inter_node"})
        links = {k: _section(p2p.get(k, {}), f"{source}: p2p.{k}", {"latency", "bandwidth"})
                 for k in ("intra_node", "inter_node")}

        def stages(name: str, value: Values) -> tuple[float, ...]:
            return split_stages(f"{source}: {name}", value, pp, vpp)

        def number(section: Mapping[str, Any], key: str, name: str, default: float, **bounds: float) -> float:
            return strict.number(section.get(key, default), f"{source}: {name}", **bounds)

        try:
            memory = _memory(top.get("memory", {}), pp, vpp, source)
            return cls.per_stage(
                pp * vpp, stages("F", comp["f"]), stages("B", comp["b"]), stages("W", comp["w"]),
                bw=None if comp.get("bw") is None else stages("BW", comp["bw"]),
                fb_overlap=number(comp, "fb_overlap", "compute.fb_overlap", 0.0, minimum=0, maximum=1),
                p2p=P2PCost(number(p2p, "message_bytes", "p2p.message_bytes", 0.0, minimum=0),
                            ranks_per_node=strict.count(p2p.get("ranks_per_node", 8), f"{source}: p2p.ranks_per_node",
                                                        minimum=1),
                            **{k: _link(v, f"{source}: p2p.{k}") for k, v in links.items()}),
                memory=memory, time_unit=strict.text(top.get("time_unit", "ms"), f"{source}: time_unit",
                                                     choices=TIME_UNITS),
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
            "compute": {"f": list(self.compute.forward), "b": list(self.compute.backward_input),
                        "w": list(self.compute.backward_weight), "fb_overlap": self.fb_overlap},
            "p2p": {"message_bytes": self.p2p.message_bytes, "ranks_per_node": self.p2p.ranks_per_node,
                    "intra_node": link(self.p2p.intra_node), "inter_node": link(self.p2p.inter_node)},
        }
        if self.fused_backward is not None:
            out["compute"]["bw"] = list(self.fused_backward)
        m = self.memory
        out["memory"] = {"w_retained_fraction": m.w_retained_fraction}
        if m.models_bytes:
            out["memory"].update(activation_bytes=list(m.activation_bytes), parameter_bytes=list(m.parameter_bytes),
                                 gradient_bytes=list(m.gradient_bytes), optimizer_bytes=list(m.optimizer_bytes))
        return out


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
    return _section(data, f"cost model {path}", {"time_unit", "compute", "p2p", "memory"})


def _memory(data: Any, pp: int, vpp: int, source: str) -> MemoryCost:
    """The ``memory`` section: the retained share alone (default :data:`W_RETAINED_FRACTION`), or bytes,
    which then must say what W keeps (the byte figures depend on it)."""
    mem = _section(data, f"{source}: memory", {"activation_bytes", "w_retained_fraction", "parameter_bytes",
                                               "gradient_bytes", "optimizer_bytes"})
    retained = strict.number(mem.get("w_retained_fraction", W_RETAINED_FRACTION),
                             f"{source}: memory.w_retained_fraction", minimum=0, maximum=1)
    if "activation_bytes" not in mem:
        if set(mem) - {"w_retained_fraction"}:
            raise ConfigError(f"{source}: memory: parameter, gradient and optimizer bytes need activation_bytes too")
        return MemoryCost(retained)
    if "w_retained_fraction" not in mem:
        raise ConfigError(f"{source}: memory lacks ['w_retained_fraction']: with activation_bytes, say what share of "
                          f"them B keeps for W (e.g. {W_RETAINED_FRACTION:.3f} with flash attention, see docs/simulator.md)")
    mem["w_retained_fraction"] = retained
    mem["activation_bytes"] = split_stages(f"{source}: memory.activation_bytes", mem["activation_bytes"], pp, vpp)
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        mem[key] = per_stage_values(f"{source}: memory.{key}", mem.get(key, 0.0), pp, "ranks")
    return MemoryCost.per_stage(pp * vpp, pp, **mem)


def _section(data: Any, name: str, allowed: set[str], required: set[str] = frozenset()) -> dict[str, Any]:
    return strict.keys(data, name, allowed, required)


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
