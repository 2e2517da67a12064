"""The parts of a cost model besides compute times: links, point-to-point and host costs, memory.

Each is a frozen value checked when built; :class:`~primuspipe.ir.cost_model.CostModel` holds one of
each, and :mod:`~primuspipe.ir.cost_file` reads them from a cost file's sections.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from primuspipe import strict
from primuspipe.errors import ConfigError
from primuspipe.ir.activations import OFFLOAD_FRACTION, W_RETAINED_FRACTION, running_levels
from primuspipe.ir.costs import Values, per_stage_values
from primuspipe.ir.kinds import NodeKind, compute_kinds
from primuspipe.ir.placement import Placement

if TYPE_CHECKING:
    from primuspipe.ir.table import ScheduleTable

TIME_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0}
"""Microseconds per time unit (the Chrome trace's unit)."""


@dataclass(frozen=True)
class Link:
    """A point-to-point path: a message of ``n`` bytes takes ``latency + n / bandwidth``."""

    latency: float = 0.0
    bandwidth: float = math.inf
    """Bytes per time unit; ``math.inf`` (the default) makes the size free."""

    def __post_init__(self) -> None:
        strict.fields(self)
        if not (0 <= self.latency < math.inf and self.bandwidth > 0):  # NaN fails every comparison
            raise ConfigError(f"a link needs latency >= 0 and bandwidth > 0, got {self}")

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class LateWork:
    """Work the weight-gradient pass (W, or BW's W) of one stage runs only for microbatch ``first`` and later:
    ``time`` more (in the cost model's unit) on those nodes, none on the earlier ones. megatron-core's
    ``wgrad_deferral_limit`` is one: with ``defer_embedding_wgrad_compute`` the output layer buffers the inputs and
    output gradients of its first ``limit`` microbatches and runs their weight-gradient GEMMs after the step's last
    backward, while every later microbatch runs its GEMM in its own backward (``tensor_parallel/layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``: ``len(grad_output_buffer) <
    wgrad_deferral_limit``); so the last stage's W costs the head's GEMM more from microbatch ``limit`` on."""

    stage: int
    first: int
    time: float

    def __post_init__(self) -> None:
        strict.fields(self)
        if self.stage < 0 or self.first < 0 or not 0 <= self.time < math.inf:
            raise ConfigError(f"late work needs a stage and a first microbatch >= 0 and a finite time >= 0, got {self}")

    def time_in(self, parts: Sequence[tuple[NodeKind, int, int]]) -> float:
        """What it adds to a node whose compute parts are ``(kind, microbatch, stage)``."""
        return sum(self.time for kind, microbatch, stage in parts
                   if kind.spec.cost in ("w", "bw") and stage == self.stage and microbatch >= self.first)


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
        strict.fields(self)
        if not (0 <= self.message_bytes < math.inf and self.ranks_per_node >= 1):
            raise ConfigError(f"p2p needs message_bytes >= 0 and ranks_per_node >= 1, got {self}")

    def transfer_time(self, src: int, dst: int) -> float:
        same_node = src // self.ranks_per_node == dst // self.ranks_per_node
        return (self.intra_node if same_node else self.inter_node).time(self.message_bytes)


MIN_SPEED = 1e-3
"""Smallest ``host.speed``: a rank's work takes ``1 / speed`` times its CPU time, so a share far below any
host's (measured 0.97-0.98) multiplies every time past what a step's sum keeps (:data:`MAX_TIME`'s bound on
each time would not hold for the times the simulator runs)."""
MAX_CONTENTION = 1e3
"""Largest ``host.contention``: it multiplies crowded work by ``1 + contention * (n - free)``; measured
figures are below 1, and far larger ones take the simulated times past what a sum keeps."""
MAX_SHARE = 1e3
"""Largest ``compute.probe_window``, ``memory.b_rise_fraction`` and ``memory.w_excess_fraction``: shares that
multiply a node's time or a microbatch's bytes; measured figures are below 1, and ``1e300`` took a step or a byte
peak past what a sum keeps -- or, in a table that never runs a probe window or a split B, passed silently."""


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
    speed: float = 1.0
    """With ``cores``: the share of a core a running rank's thread gets even with a core to itself (0 to 1):
    what a hypervisor steals, interrupts, and other threads that land on its core take. A rank then runs
    at ``min(speed, free / n)`` of a core: alone, or with a core per busy rank, a node of CPU time ``t``
    takes ``t / speed``. 1 (the default): a rank alone gets a whole core. Measured on this repository's
    2-core CPU host, nodes that ran alone took as much longer than their CPU time (2-3 %) as nodes that ran
    beside the other rank: the loss is not sharing, so ``cores`` alone charged it only while both ran."""
    message_cpu: float = 0.0
    """With ``cores``: the CPU time a rank's process spends outside its main thread on each message it
    sends or receives (the communication threads that move it), on top of ``background``; the simulator
    spreads a rank's messages' CPU over its step like ``background`` (the share ``message_cpu x messages
    / step``). Measured on this repository's 2-core CPU host with 3 ranks (gloo), the middle rank of 1F1B,
    with twice the end ranks' messages, took 0.12-0.28 ms more per message, and the vpp = 2 schedules,
    with two to three times 1F1B's messages, 1.4-2.2 times its background: a rate alone, fitted on 1F1B,
    left them predicted 1-5 % fast. 0 (the default): background CPU follows the step's length only."""

    def __post_init__(self) -> None:
        strict.fields(self)
        object.__setattr__(self, "overhead", tuple(sorted(self.overhead)))  # one model, one value
        self._check_overhead_kinds()
        values = [v for _, v in self.overhead] + [self.send, self.recv, self.background, self.contention,
                                                  self.message_cpu,
                                                  *(self.step_gap or ())]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ConfigError(f"host times must be >= 0 and finite, got {self}")
        if self.cores is not None and not (math.isfinite(self.cores) and self.cores > 0):
            raise ConfigError(f"host.cores must be a number > 0 (or omitted), got {self.cores}")
        if not (math.isfinite(self.speed) and MIN_SPEED <= self.speed <= 1):
            raise ConfigError(f"host.speed must be a share of a core in [{MIN_SPEED:g}, 1], got {self.speed}")
        if self.contention > MAX_CONTENTION:
            raise ConfigError(f"host.contention must be at most {MAX_CONTENTION:g} (a share of the work each crowding "
                              f"job adds), got {self.contention:g}")

    def _check_overhead_kinds(self) -> None:
        """Each overhead names a compute kind once, by the lower-case name :meth:`before` looks up (the cost file's
        ``host.overhead`` keys): ``("zz", 1.0)`` or ``("F", 1.0)`` was kept and never charged, and a kind named twice
        charged whichever came last."""
        known = [k.name.lower() for k in compute_kinds()]
        names = [name for name, _ in self.overhead]
        for name in names:
            if name not in known:
                raise ConfigError(f"host.overhead names {strict.show(name)}, which is no compute kind's name; give "
                                  f"one of {', '.join(known)}{strict.did_you_mean(name.lower(), known)}")
            if names.count(name) > 1:
                raise ConfigError(f"host.overhead gives kind {name!r} {names.count(name)} times; give each kind once")

    def before(self, kind: NodeKind) -> float:
        """Rank time before a node of ``kind``."""
        return dict(self.overhead).get(kind.name.lower(), 0.0)

    def post(self, kind: NodeKind) -> float:
        """Rank time to post a node of a communication ``kind``."""
        return self.send if kind.is_send else self.recv


MAX_BYTES = 1e18
"""Largest byte count of a memory field: an exabyte, millions of times any device's memory. ``1e308`` parameter and
gradient bytes summed past a float in the peaks, refused after the simulation as a "peak_memory_bytes" too large
for a number with advice to give smaller times."""


@dataclass(frozen=True)
class MemoryCost:
    """What a rank holds: activations of microbatches in flight, and (optionally) bytes.

    Release rule: F takes a microbatch's activations of its stage; B releases all but
    ``w_retained_fraction`` of them (what the deferred W still needs, the inputs of its GEMMs); W
    releases the rest; a fused BW releases everything. In bytes B also keeps ``w_excess_fraction`` more until
    W, and peaks ``b_rise_fraction`` above where it started. Memory counted this way is what the device
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
    b_rise_fraction: float = 0.0
    """Share of a microbatch's activations by which a split-backward B's peak tops what the rank held when it
    started (the byte peaks count it; :attr:`~primuspipe.ir.kinds.KindSpec.rise`): what B has kept for W by
    then, which a fused backward would have freed. 0: B peaks where it starts (a cost file says otherwise)."""
    w_excess_fraction: float = 0.0
    """Share of a microbatch's activations that W keeps on top of ``w_retained_fraction`` where W needs more
    than F left (sequence parallelism all-gathers the row-parallel projections' output gradients W reads; a
    full recompute rebuilds what W reads): the byte peaks hold ``w_retained_fraction + w_excess_fraction``
    from B until W, the microbatch units (the validator's and the algorithms' count) a share of at most 1."""

    def __post_init__(self) -> None:
        strict.fields(self)
        if not 0.0 <= self.w_retained_fraction <= 1.0:
            raise ConfigError(f"w_retained_fraction must be in [0, 1], got {self.w_retained_fraction}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ConfigError(f"memory.offload_fraction must be in [0, 1], got {self.offload_fraction}")
        for name in ("b_rise_fraction", "w_excess_fraction"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0.0):
                raise ConfigError(f"memory.{name} must be a finite number >= 0, got {getattr(self, name)}")
        for name in ("activation_bytes", "parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            if not all(0.0 <= x <= MAX_BYTES for x in getattr(self, name) or ()):  # NaN fails every comparison
                raise ConfigError(f"memory.{name} must be finite numbers in [0, {MAX_BYTES:g}] bytes, got "
                                  f"{strict.show(getattr(self, name))}")
        if not (len(self.parameter_bytes) == len(self.gradient_bytes) == len(self.optimizer_bytes)):
            raise ConfigError("parameter, gradient and optimizer bytes need one value per rank each")

    @classmethod
    def per_stage(
        cls, num_stages: int, pp: int, *, activation_bytes: Values, w_retained_fraction: float = W_RETAINED_FRACTION,
        parameter_bytes: Values = 0.0, gradient_bytes: Values = 0.0, optimizer_bytes: Values = 0.0,
        offload_fraction: float = OFFLOAD_FRACTION, b_rise_fraction: float = 0.0, w_excess_fraction: float = 0.0,
    ) -> MemoryCost:
        return cls(
            float(w_retained_fraction), per_stage_values("activation_bytes", activation_bytes, num_stages, "stages"),
            per_stage_values("parameter_bytes", parameter_bytes, pp, "ranks"),
            per_stage_values("gradient_bytes", gradient_bytes, pp, "ranks"),
            per_stage_values("optimizer_bytes", optimizer_bytes, pp, "ranks"),
            float(offload_fraction), float(b_rise_fraction), float(w_excess_fraction),
        )

    @property
    def bytes_retained(self) -> float:
        """The share of a microbatch's activations the byte peaks hold from B until W."""
        return self.w_retained_fraction + self.w_excess_fraction

    @property
    def models_bytes(self) -> bool:
        return self.activation_bytes is not None

    def static_bytes(self, rank: int) -> float:
        if not self.parameter_bytes:
            return 0.0
        return self.parameter_bytes[rank] + self.gradient_bytes[rank] + self.optimizer_bytes[rank]

    def _bytes(self) -> tuple[float, ...]:
        """:attr:`activation_bytes`; a caller that counts bytes with a model that has none (a plug-in calling
        :meth:`peak_bytes`, say) is told so, as a ConfigError rather than an assert that ``python -O`` drops."""
        if self.activation_bytes is None:
            raise ConfigError("this cost model gives no activation bytes (memory.activation_bytes), so it cannot "
                              "count a table's bytes; give them, or count in microbatches (memory_limit)")
        return self.activation_bytes

    def byte_count(self, stages: Sequence[int]) -> dict[str, Any]:
        """The one counter's settings (:func:`~primuspipe.ir.activations.running_levels`,
        :func:`~primuspipe.ir.activations.timed_levels`) that count a rank holding model ``stages`` (its
        chunks') in bytes: each chunk its stage's activation bytes, ``bytes_retained`` from B until W, a B's
        rise. The simulator's byte peaks and the algorithms' byte budgets both count with these."""
        weights = self._bytes()
        weight: Callable[[int], float] = lambda chunk: weights[stages[chunk]]  # noqa: E731
        return dict(chunk_weight=weight, retained=self.bytes_retained, offloaded=self.offload_fraction,
                    rise=self.b_rise_fraction)

    def peak_bytes(self, table: ScheduleTable) -> list[float]:
        """Per rank of a compute table whose stages this model describes: the most activation bytes held at
        once, in table order (the simulator's byte peak of a table without host copies, whatever the timing)."""
        return [max(running_levels(row, **self.byte_count(table.placement.stages[rank])), default=0.0)
                for rank, row in enumerate(table.ranks)]

    def chunk_caps(self, placement: Placement, limit_bytes: Sequence[float]) -> tuple[float, float]:
        """What a per-rank byte budget ``limit_bytes`` allows in the unit count the algorithms construct with
        (chunk activations, ``w_retained_fraction`` from B until W): ``(sure, loose)``. A table within ``sure``
        chunks on every rank fits the byte budget (each unit at the rank's largest chunk bytes, a share held
        until W at up to ``bytes_retained / w_retained_fraction`` of its count, a B's rise on top); every table
        that fits holds at most ``loose`` (each unit at the rank's smallest chunk bytes, never more than the
        bytes count). Between the two only the byte count (:meth:`peak_bytes`) decides."""
        activation_bytes = self._bytes()
        sure, loose = math.inf, 0.0
        for rank, stages in enumerate(placement.stages):
            sizes = [activation_bytes[s] for s in stages]
            biggest, smallest = max(sizes), min(sizes)
            if biggest <= 0:
                loose = math.inf  # this rank holds nothing it could overflow
                continue
            loose = max(loose, limit_bytes[rank] / smallest if smallest > 0 else math.inf)
            if self.w_retained_fraction > 0:
                growth = max(1.0, self.bytes_retained / self.w_retained_fraction)
            else:  # B keeps nothing in units: a unit count bounds the bytes only if it keeps none in bytes either
                growth = 1.0 if self.w_excess_fraction == 0 else math.inf
            sure = min(sure, max(0.0, (limit_bytes[rank] - self.b_rise_fraction * biggest) / (growth * biggest)))
        return sure, loose
