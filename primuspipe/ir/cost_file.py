"""The cost file: its YAML form, and the readers of its sections.

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
      cold_start: {f: 0.3, b: 0.1, w: 0.05}  # extra time of a chunk's first F, B, W (bw: BW; default b + w) in a step
      fixed: {f: [0.3, 0.2], b: [0.2, 0.3], w: 0.05, bw: [0.3, 0.4]}  # part of each time outside the layers
      chunk: {f: 0.15, b: 0.1}   # of that, what each chunk pays (without the embedding and loss head)
      w_warm: 0.8            # W run right after its own B or another W of its chunk; omitted: w wherever it runs
      probe_window: 0.1      # share of extra time of the node that opens a window of deferred Ws (or one per rank)
      late_w: {stage: 7, first: 22, time: 0.3}  # model stage 7's W (BW) of microbatch 22 on takes 0.3 more
    host:                    # time on the host, outside the kernels (every key optional, default 0)
      overhead: {f: 0.03, b: 0.04, w: 0.02, bw: 0.04}   # rank time before each node of a kind
      send: 0.15             # rank time to post a send (the transfer can start once it is posted)
      recv: 0.10             # rank time to post a receive
      cores: 2               # cores the ranks of one node share; omitted: one per rank (no contention)
      background: 0.05       # with cores: share of a core each rank's process keeps busy off its main thread
      message_cpu: 0.002     # with cores: CPU off the main thread per message a rank sends or receives
      contention: 0.03       # with cores: extra CPU per unit of work for each job beyond the free cores
      speed: 0.98            # with cores: share of a core a rank gets even with one to itself (default 1)
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
      b_rise_fraction: 0.0               # share by which a B's peak tops its start (what it kept for W; default 0)
      w_excess_fraction: 0.0             # share W keeps beyond w_retained_fraction, in bytes only (default 0)
      activation_bytes: 2.0e9            # per 1F1B stage, one microbatch, held from F until released
      parameter_bytes: 1.0e9             # per rank
      gradient_bytes: 1.0e9
      optimizer_bytes: 4.0e9

``compute.fixed`` (optional; per kind, one number or a value per 1F1B stage like the times) is the part
of each time spent outside the model's layers: a chunk's own cost (its Python, dispatch and launches,
paid once per chunk and node), with the embedding on the first stage and the loss head on the last.
Without it a 1F1B stage's time is cut evenly over its ``vpp`` chunks, which loses that every chunk pays
its own fixed cost; with it a model stage gets its share of the layers plus a chunk's fixed cost, and the
first and last model stages keep the embedding's and the head's (:func:`split_fixed`; under the V
placement the last model stage, with the head, sits on rank 0). ``compute.chunk`` (optional, per kind
given in ``fixed``) is the fixed cost each chunk pays, ``fixed`` less the embedding's and loss head's
time; without it, it is estimated from ``fixed`` (:func:`chunk_fixed`). ``primuspipe calibrate`` writes
both from a dump whose events time the layers and those modules (the Megatron backend's;
``TimedNode.layers`` and ``ends``); a backend that does not know the model's layers (``TorchPipeline``'s
user modules) dumps neither, and the file keeps the even split.

``compute.w_warm`` (optional; like the times) is what a *warm* W costs: one its rank runs right after
the B of its own microbatch and chunk or right after another W of its chunk
(:func:`~primuspipe.ir.row_context.warm_weight_grad`); ``compute.w`` is then what a cold one costs (after
a forward or another microbatch's B). Cut for ``vpp`` chunks, each chunk's warm W is its W less
``(w - w_warm) / vpp`` (:func:`warm_stages`: the cache's saving is in the layers' weight GEMMs, so it
divides like them). A file without it charges W alike wherever it runs, as it always did.

``compute.probe_window`` (optional, a share >= 0 or a list of one per rank, default 0) is how much longer the
node takes that opens a window, the first to run while its rank holds a deferred W's inputs
(:func:`~primuspipe.ir.row_context.window_openings`), in any table; ``primuspipe calibrate`` measures it per
rank from the window openings of a probed run (:func:`~primuspipe.ir.row_context.probe_windows`), so that
neither the forward's time nor ``host.cores`` takes it in, and a split-backward schedule's ranks that defer
a W pay their rank's share where each window opens.

``compute.late_w`` (optional) is time one model stage's W (or BW) takes more from some microbatch on
(:class:`~primuspipe.ir.cost_parts.LateWork`): ``stage`` indexes the table's ``pp * vpp`` model stages, not
1F1B stages; the projection writes it for megatron-core's partial deferral of the output layer's weight
gradients (``wgrad_deferral_limit``).

:meth:`CostModel.from_dict <primuspipe.ir.cost_model.CostModel.from_dict>` reads it with the section
readers below.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from primuspipe import strict
from primuspipe.errors import ConfigError
from primuspipe.ir.activations import OFFLOAD_FRACTION, W_RETAINED_FRACTION
from primuspipe.ir.cost_parts import MAX_CONTENTION, MAX_SHARE, MIN_SPEED, HostCost, LateWork, Link, MemoryCost
from primuspipe.ir.costs import ComputeCosts, Values, per_stage_values
from primuspipe.ir.kinds import compute_kinds


def counts_taken(pp: int, vpp: int) -> str:
    """The value counts a per-stage time takes, in words, for messages.

    >>> counts_taken(4, 1), counts_taken(4, 2)
    ('one number or 4 (one per 1F1B stage)', 'one number, 4 (one per 1F1B stage) or 8 (one per model stage at vpp=2)')
    """
    if vpp == 1:
        return f"one number or {pp} (one per 1F1B stage)"
    return f"one number, {pp} (one per 1F1B stage) or {pp * vpp} (one per model stage at vpp={vpp})"


def split_stages(name: str, value: Values, pp: int, vpp: int) -> tuple[float, ...]:
    """Per-model-stage values from 1F1B-stage values (module docstring): model stage ``s`` gets
    ``value[s // vpp] / vpp``; a list of ``pp * vpp`` values is taken as is.

    >>> split_stages("F", [2, 4], pp=2, vpp=2)
    (1.0, 1.0, 2.0, 2.0)
    """
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        if len(value) == pp * vpp:
            return per_stage_values(name, value, pp * vpp, "stages")
        if len(value) != pp:
            raise ConfigError(f"{name} has {len(value)} values; give {counts_taken(pp, vpp)}")
    per_1f1b_stage = per_stage_values(name, value, pp, "1F1B stages")
    return tuple(per_1f1b_stage[s // vpp] / vpp for s in range(pp * vpp))


def stage_totals(values: Sequence[float], pp: int) -> list[float]:
    """Per 1F1B stage, the sum of its model stages' ``values`` (``len(values) // pp`` consecutive ones each): what
    :func:`split_stages` cuts, put back together -- for a file written per 1F1B stage, or a model re-cut for
    another vpp.

    >>> stage_totals([1.0, 1.0, 2.0, 2.0], pp=2)
    [2.0, 4.0]
    """
    k = len(values) // pp
    return [sum(values[i * k:(i + 1) * k]) for i in range(pp)]


def chunk_fixed(fixed: Sequence[float]) -> float:
    """A chunk's own fixed cost, from per-stage fixed parts in pipeline order: what a stage holding
    neither the embedding (the first) nor the loss head (the last) pays, the median of the inner stages;
    with two stages the smaller of the two (it still holds the embedding or the head, so it is an upper
    bound); with one, its own."""
    inner = fixed[1:-1]
    return statistics.median(inner) if inner else min(fixed)


def split_fixed(name: str, value: Values, fixed: Values, pp: int, vpp: int, fixed_name: str = "compute.fixed",
                chunk: Values | None = None, chunk_name: str = "compute.chunk") -> tuple[tuple[float, ...], ...]:
    """``(times, fixed parts, chunks' own fixed costs)`` per model stage from a 1F1B-stage time, its fixed
    part (``compute.fixed``) and the fixed cost each of its chunks pays (``compute.chunk``; default
    :func:`chunk_fixed` of the fixed parts), module docstring: model stage ``s`` of 1F1B stage ``k`` gets
    ``(value[k] - fixed[k]) / vpp`` of layers plus ``chunk[k]``, except the chunk that holds what made
    stage ``k`` differ -- the first model stage (embedding), the last (loss head), the first chunk of a
    middle stage -- which keeps ``fixed[k]``. At ``vpp = 1`` that is the value itself. A time given per
    model stage (``pp * vpp`` values) needs its fixed parts per model stage too, and all are taken as is.

    >>> split_fixed("F", [10, 12], [2, 4], pp=2, vpp=2, chunk=[1.5, 1.5])
    ((6.0, 5.5, 5.5, 8.0), (2.0, 1.5, 1.5, 4.0), (1.5, 1.5, 1.5, 1.5))
    """
    n = pp * vpp
    if n != pp and isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)) and len(value) == n:
        own = per_stage_values(fixed_name, fixed, n, "stages")
        return (split_stages(name, value, pp, vpp), own,
                own if chunk is None else per_stage_values(chunk_name, chunk, n, "stages"))
    total = per_stage_values(name, value, pp, "1F1B stages")
    own = per_stage_values(fixed_name, fixed, pp, "1F1B stages")
    for k, (t, f) in enumerate(zip(total, own)):
        if f > t * (1 + 1e-9):
            raise ConfigError(f"{fixed_name}[{k}] = {f:g} is more than {name}[{k}] = {t:g}; the fixed part is the "
                              "part of the time spent outside the layers, at most the time itself")
    if chunk is None:  # estimated: at most the stage's own fixed part
        each = tuple(min(chunk_fixed(own), f) for f in own)
    else:
        each = per_stage_values(chunk_name, chunk, pp, "1F1B stages")
    for k, (c, f) in enumerate(zip(each, own)):
        if c > f * (1 + 1e-9):
            raise ConfigError(f"{chunk_name}[{k}] = {c:g} is more than {fixed_name}[{k}] = {f:g}; a chunk's own "
                              "fixed cost is the fixed part less the embedding's and loss head's, at most it")
    holder = [(0 if k == 0 or k < pp - 1 else vpp - 1) for k in range(pp)]
    parts = tuple(own[k] if j == holder[k] else each[k] for k, j in (divmod(s, vpp) for s in range(n)))
    times = total if vpp == 1 else tuple((total[s // vpp] - own[s // vpp]) / vpp + parts[s] for s in range(n))
    return times, parts, tuple(each[s // vpp] for s in range(n))


def merge_fixed(times: Sequence[float], fixed: Sequence[float], chunk: Sequence[float], pp: int) -> tuple[list[float], ...]:
    """The inverse of :func:`split_fixed`: per 1F1B stage, the time and the fixed part of its ``vpp``
    model stages together, less the ``vpp - 1`` chunks' own fixed costs a 1F1B stage does not pay, and its
    chunks' own fixed cost (their mean).

    >>> merge_fixed((6.0, 5.5, 5.5, 8.0), (2.0, 1.5, 1.5, 4.0), (1.5, 1.5, 1.5, 1.5), pp=2)
    ([10.0, 12.0], [2.0, 4.0], [1.5, 1.5])
    """
    vpp = len(times) // pp
    group = [slice(k * vpp, (k + 1) * vpp) for k in range(pp)]
    each = [statistics.fmean(chunk[g]) for g in group]
    totals = [max(0.0, sum(times[g]) - (vpp - 1) * c) for c, g in zip(each, group)]
    own = [min(t, max(c, sum(fixed[g]) - (vpp - 1) * c)) for t, c, g in zip(totals, each, group)]
    return totals, own, each


def warm_stages(w: Sequence[float], saving: Sequence[float]) -> tuple[float, ...]:
    """Per model stage, the time of a warm W: the stage's W less its share of its 1F1B stage's
    ``saving`` (``w - w_warm`` per 1F1B stage, ``len(w) // len(saving)`` chunks each);
    never below 0.

    >>> warm_stages([3.0, 3.0, 5.0, 5.0], [1.0, 2.0])
    (2.5, 2.5, 4.0, 4.0)
    """
    vpp = len(w) // len(saving)
    return tuple(max(0.0, t - saving[s // vpp] / vpp) for s, t in enumerate(w))


MAKE_ONE = ("'primuspipe calibrate DUMP_DIR -o FILE' writes one from a run's dump; docs/simulator.md, 'Cost model', "
            "shows the format")
"""How a cost file is made, for the refusal of a path that does not exist."""


def read_cost_file(path: str | Path) -> dict[str, Any]:
    """The raw YAML mapping of a cost file (resolve it per shape with :meth:`CostModel.from_dict`)."""
    data = strict.load_yaml(strict.read_text(path, "cost model", missing=MAKE_ONE), f"cost model {path}")
    return strict.keys(data, f"cost model {path}", SECTIONS)


def memory_section(data: Any, pp: int, vpp: int, source: str) -> MemoryCost:
    """The ``memory`` section: the retained share alone (default :data:`W_RETAINED_FRACTION`), or bytes,
    which then must say what W keeps (the byte figures depend on it)."""
    mem = strict.keys(data, f"{source}: memory", {"activation_bytes", "w_retained_fraction", "parameter_bytes",
                                                  "gradient_bytes", "optimizer_bytes", "offload_fraction",
                                                  "b_rise_fraction", "w_excess_fraction"})
    retained = strict.number(mem.get("w_retained_fraction", W_RETAINED_FRACTION),
                             f"{source}: memory.w_retained_fraction", minimum=0, maximum=1)
    offload = strict.number(mem.get("offload_fraction", OFFLOAD_FRACTION), f"{source}: memory.offload_fraction",
                            minimum=0, maximum=1)
    shares = {key: strict.number(mem.get(key, 0.0), f"{source}: memory.{key}", minimum=0, maximum=MAX_SHARE)
              for key in ("b_rise_fraction", "w_excess_fraction")}
    if "activation_bytes" not in mem:
        if set(mem) - {"w_retained_fraction", "offload_fraction", *shares}:
            raise ConfigError(f"{source}: memory: parameter, gradient and optimizer bytes need activation_bytes too")
        return MemoryCost(retained, offload_fraction=offload, **shares)
    if "w_retained_fraction" not in mem:
        raise ConfigError(f"{source}: memory lacks ['w_retained_fraction']: with activation_bytes, say what share of "
                          f"them B keeps for W (e.g. {W_RETAINED_FRACTION:.3f} with flash attention, see docs/simulator.md)")
    mem.update(w_retained_fraction=retained, offload_fraction=offload, **shares)
    mem["activation_bytes"] = split_stages(f"{source}: memory.activation_bytes", mem["activation_bytes"], pp, vpp)
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        mem[key] = per_stage_values(f"{source}: memory.{key}", mem.get(key, 0.0), pp, "ranks")
    return MemoryCost.per_stage(pp * vpp, pp, **mem)


def window_section(value: Any, pp: int, name: str) -> float | tuple[float, ...]:
    """``compute.probe_window``: one share for every rank, or a list with one per rank (each at most
    :data:`~primuspipe.ir.cost_parts.MAX_SHARE`).

    >>> window_section(0.1, 2, "probe_window"), window_section([0.08, 0.02], 2, "probe_window")
    (0.1, (0.08, 0.02))
    """
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        shares = per_stage_values(name, value, pp, "ranks")
        for rank, share in enumerate(shares):
            strict.number(share, f"{name}[{rank}]", minimum=0, maximum=MAX_SHARE)
        return shares
    return strict.number(value, name, minimum=0, maximum=MAX_SHARE)


def late_section(value: Any, name: str) -> LateWork | None:
    """``compute.late_w``: ``{stage, first, time}`` (:class:`~primuspipe.ir.cost_parts.LateWork`), or None."""
    if value is None:
        return None
    data = strict.keys(value, name, {"stage", "first", "time"}, required={"stage", "first", "time"})
    return LateWork(strict.count(data["stage"], f"{name}.stage"), strict.count(data["first"], f"{name}.first"),
                    strict.number(data["time"], f"{name}.time", minimum=0))


def link_section(data: Mapping[str, Any], name: str) -> Link:
    """A link's YAML form; a missing or null bandwidth is unlimited (infinity itself is refused)."""
    latency = strict.number(data.get("latency", 0.0), f"{name}.latency", minimum=0)
    if data.get("bandwidth") is None:
        return Link(latency)
    bandwidth = strict.number(data["bandwidth"], f"{name}.bandwidth")
    if bandwidth <= 0:
        raise ConfigError(f"{name}: a link needs bandwidth > 0 (bytes per time unit; null or no key for unlimited), "
                          f"got {bandwidth:g}")
    return Link(latency, bandwidth)


SECTIONS = {"time_unit", "compute", "host", "p2p", "memory", "host_link"}
COMPUTE_FIELDS = {"f", "b", "w", "bw", "fb_overlap", "cold_start", "fixed", "chunk", "w_warm", "probe_window",
                  "late_w"}
"""The ``compute`` keys the model reads itself; any other is a timed kind's cost key."""


def cost_keys() -> set[str]:
    """The cost keys of every timed kind in the kind table (``f``, ``b``, ``w``, ``bw`` and any a
    plug-in kind names): what a cost file's ``compute`` section may time."""
    return {k.spec.cost for k in compute_kinds() if k.spec.cost is not None}


SHARED_CORE_KEYS = {"background": 0.0, "contention": 0.0, "speed": 1.0, "message_cpu": 0.0}
"""``host`` fields that only mean something with ``host.cores`` (the shared-cores simulator's terms), with the
values that change nothing (written by ``CostModel.to_dict`` whatever the cores)."""


def host_section(data: Any, pp: int) -> HostCost:
    host = strict.keys(data, "host", {"overhead", "send", "recv", "cores", "background", "contention", "step_gap",
                                         "speed", "message_cpu"})
    overhead = strict.keys(host.get("overhead", {}), "host.overhead", {k.name.lower() for k in compute_kinds()})
    cores, gap = host.get("cores"), host.get("step_gap")

    def time(value: Any, name: str) -> float:  # strictly a number: YAML's true is not 1 second
        return strict.number(value, f"host.{name} (a time >= 0)", minimum=0)

    parsed = HostCost(tuple((k, time(v, f"overhead.{k}")) for k, v in overhead.items()),
                      time(host.get("send", 0.0), "send"), time(host.get("recv", 0.0), "recv"),
                      None if cores is None else strict.number(cores, "host.cores (a number of cores > 0)", above=0),
                      strict.number(host.get("background", 0.0), "host.background (a share of a core >= 0)", minimum=0),
                      strict.number(host.get("contention", 0.0), "host.contention (a share >= 0)", minimum=0,
                                    maximum=MAX_CONTENTION),
                      None if gap is None else per_stage_values("host.step_gap", gap, pp, "ranks"),
                      strict.number(host.get("speed", 1.0), f"host.speed (a share of a core in [{MIN_SPEED:g}, 1])",
                                    minimum=MIN_SPEED, maximum=1),
                      time(host.get("message_cpu", 0.0), "message_cpu"))
    if cores is None and (shared := [k for k, default in SHARED_CORE_KEYS.items() if getattr(parsed, k) != default]):
        raise ConfigError(f"host.{shared[0]} is given without host.cores: it describes ranks sharing a node's cores and "
                          "would be ignored; give host.cores (the cores the ranks of one node share) or remove "
                          f"{', '.join('host.' + k for k in shared)}")
    return parsed


def cold_start_section(data: Any, pp: int, vpp: int) -> ComputeCosts | None:
    """``compute.cold_start`` per model stage: like the times, per 1F1B stage and split among its chunks."""
    if data is None:
        return None
    cold = strict.keys(data, "compute.cold_start", cost_keys())

    def times(key: str) -> tuple[float, ...]:
        return split_stages(f"compute.cold_start.{key}", cold.get(key, 0.0), pp, vpp)

    return ComputeCosts(times("f"), times("b"), times("w"), tuple((k, times(k)) for k in set(cold) - {"f", "b", "w"}))
