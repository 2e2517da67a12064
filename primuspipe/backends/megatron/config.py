"""primuspipe's settings for Megatron: a typed dataclass read from YAML and/or environment variables.

Environment variables override the YAML file; ``PRIMUSPIPE_CONFIG`` names the YAML file when no path
is given. Primus's ``primus_pipeline.yaml`` loads as it is: its keys are ours, with the same meaning
(docs/primus.md). Every key (YAML name / environment variable):

=========================  =================================  ==========================================
``patch_primus_pipeline``  ``PRIMUSPIPE_PATCH``               master switch; ``install`` does nothing when false
``pp_algorithm``           ``PRIMUSPIPE_PP_ALGORITHM``        algorithm name or alias; ``auto`` = 1f1b / interleaved-1f1b
``algorithm_options``      ``PRIMUSPIPE_ALGORITHM_OPTIONS``   mapping of the algorithm's options (env: JSON)
``dump_pp_data``           ``PRIMUSPIPE_DUMP_PP_DATA``        write a timeline per rank and iteration
``dump_dir``               ``PRIMUSPIPE_DUMP_DIR``            where the timelines go
``watchdog_timeout_s``     ``PRIMUSPIPE_WATCHDOG_TIMEOUT_S``  hang watchdog; 0 turns it off
``communication_method``   ``PRIMUSPIPE_COMMUNICATION_METHOD`` ``async_p2p`` (``batch_p2p`` is refused)
``debug_scheduler_table``  ``PRIMUSPIPE_DEBUG_SCHEDULER_TABLE`` print each new table's grid on pipeline rank 0
``offload``                ``PRIMUSPIPE_OFFLOAD``             OFFLOAD/RELOAD nodes under ``pp_max_mem``
``offload_ops``            ``PRIMUSPIPE_OFFLOAD_OPS``         which activations move (default: all a chunk saves)
``offload_fraction``       ``PRIMUSPIPE_OFFLOAD_FRACTION``    share of a chunk's activations ``offload_ops`` hold
``pp_cost_f/b/w``          ``PRIMUSPIPE_PP_COST_F/B/W``       F / B / W time per stage (number or list; env: JSON)
``pp_max_mem``             ``PRIMUSPIPE_PP_MAX_MEM``          activation limit per rank, microbatches until W
``split_probe``            ``PRIMUSPIPE_SPLIT_PROBE``         calibration: ~2N+1 backwards per chunk run as B and W
``auto_replan``            ``PRIMUSPIPE_AUTO_REPLAN``         measure the first steps, switch to the best schedule
``auto_replan_warmup``     ``PRIMUSPIPE_AUTO_REPLAN_WARMUP``  steps before measuring (default 2)
``auto_replan_steps``      ``PRIMUSPIPE_AUTO_REPLAN_STEPS``   steps measured (default 3)
``auto_replan_threshold``  ``PRIMUSPIPE_AUTO_REPLAN_THRESHOLD`` predicted gain needed to switch (default 0.03)
``auto_replan_memory_limit`` ``PRIMUSPIPE_AUTO_REPLAN_MEMORY_LIMIT`` peak bytes per rank a new schedule may use
``auto_replan_algorithms`` ``PRIMUSPIPE_AUTO_REPLAN_ALGORITHMS`` comma-separated algorithms to choose among
``auto_replan_verify``     ``PRIMUSPIPE_AUTO_REPLAN_VERIFY``  steps after the decision timed against the prediction (default 3)
=========================  =================================  ==========================================

>>> load_config(env={"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_PP_ALGORITHM": "gpipe"}).pp_algorithm
'gpipe'
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from primuspipe.calibration.replan import ENV_NAMES as REPLAN_ENV_NAMES, ReplanSettings, checked_setting, memory_limit
from primuspipe.errors import ConfigError, PrimusPipeError
from primuspipe import strict
from primuspipe.ir.cost_model import CostModel, MemoryCost, read_cost_file
from primuspipe.ir.costs import per_stage_values
from primuspipe.runtime.driver import MAX_TIMEOUT_S

AUTO = "auto"
ASYNC_P2P, BATCH_P2P = "async_p2p", "batch_p2p"
PRIMUS_DEFAULT_COST = 1000.0
"""The time Primus gives an F, B or W whose ``pp_cost_*`` is null; only the ratios matter."""
OFFLOAD_OPS = MappingProxyType({
    "attn": ("core_attention",),
    "column_parallel_gemm": ("linear_qkv", "linear_fc1"),
    "row_parallel_gemm": ("linear_proj", "linear_fc2"),
    "basic_gemm": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
    "grouped_linear": ("experts",),
})
"""Primus's ``offload_ops`` names -> the megatron-core submodules (parts of their qualified names) whose
saved activations move: ``attn`` is the attention op itself (``core_attention``), the GEMM names the
tensor-parallel linear layers that kind of GEMM runs in, ``grouped_linear`` the MoE experts."""


@dataclass(frozen=True)
class PrimusPipeConfig:
    patch_primus_pipeline: bool = False
    """Master switch: replace Megatron's forward-backward function. Off unless asked for, so a config
    read from an empty environment leaves Megatron untouched."""
    pp_algorithm: str = AUTO
    """A registered algorithm or an alias such as Primus's ``zbv-formatted`` (``primuspipe list``);
    ``auto`` picks Megatron's own choice: ``1f1b`` for vpp = 1, ``interleaved-1f1b`` for vpp > 1."""
    algorithm_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Keyword options of the algorithm, e.g. ``{"microbatch_group_size": 4}`` for interleaved-1f1b
    (with ``auto``, they are interleaved-1f1b's: 1f1b takes none). Without one, interleaved-1f1b follows
    Megatron's ``microbatch_group_size_per_vp_stage``. Checked against the algorithm at :func:`install`.
    ``cost`` is the cost model cost-aware algorithms plan with: a cost-file mapping, or the path of a cost
    file (what ``primuspipe calibrate`` writes), read when the config is built."""
    dump_pp_data: bool = False
    """Write each rank's per-node start/end times and peak memory for every training iteration."""
    dump_dir: str = "pp_data"
    """Directory of the dumps (``iter_<n>/rank_<r>.json``, primuspipe timeline format)."""
    watchdog_timeout_s: float = 300.0
    """A send or receive not complete this long after it was posted raises PipelineHangError naming the
    rank, node, peer and the ranks that stopped beating; 0 disables the watchdog. It never blocks the host
    on NCCL (a monitor thread watches; see runtime/transport.py)."""
    communication_method: str = ASYNC_P2P
    """Primus's choice of point-to-point calls. ``async_p2p`` (each transfer its own non-blocking send or
    receive) is what the runner does and what the validator proves deadlock-free; ``batch_p2p`` is
    refused, since batching a rank's sends and receives changes the matching order that proof relies on."""
    debug_scheduler_table: bool = False
    """Print every newly built table's grid (with its SEND/RECV nodes) on pipeline rank 0, as Primus
    prints its scheduler table."""
    offload: bool = False
    """Move activations to host memory between F and B: the algorithm's table goes through the offload
    pass (OFFLOAD/RELOAD nodes, docs/offload.md), which brings every rank under ``pp_max_mem`` (required
    with it; the algorithm itself then plans without a memory limit, except zb-auto, which searches under it and
    weighs the pass's copies itself, as ``primuspipe simulate --offload``) using the ``pp_cost_*`` times."""
    offload_ops: str = ""
    """Comma-separated Primus op names whose saved activations move (:data:`OFFLOAD_OPS`: ``attn``,
    ``column_parallel_gemm``, ...); empty moves everything a chunk's forward saves."""
    offload_fraction: float | None = None
    """The share of a chunk's saved activations that ``offload_ops`` hold, which the offload pass plans
    with (required with ``offload_ops``; the run logs the measured share, and warns when it is smaller)."""
    pp_cost_f: Any = None
    """Forward time per pipeline stage: one number or one per rank (null: Primus's default, 1000). With
    ``pp_cost_b``/``pp_cost_w`` it becomes the cost model every cost-aware algorithm plans with (zb-h1,
    zb-h2, v-half, v-min, zb-auto / zero-bubble-heuristic); Primus uses it for zero-bubble-heuristic only."""
    pp_cost_b: Any = None
    """Input-gradient backward (B) time per stage, like ``pp_cost_f``."""
    pp_cost_w: Any = None
    """Weight-gradient backward (W) time per stage, like ``pp_cost_f``."""
    pp_max_mem: float | None = None
    """Activation limit per rank for memory-aware algorithms (zb-auto / zero-bubble-heuristic), in
    microbatches of one 1F1B stage, each counted whole from its F until its W -- Primus's count (it adds
    1 at F and takes 1 at W), so the cost model built from ``pp_cost_*`` has ``w_retained_fraction`` 1 when
    it is set (a cost file in ``algorithm_options.cost`` keeps its own)."""

    split_probe: int = 0
    """Calibration probe: run the fused backward (BW) of ``2 * split_probe + 1`` microbatches per chunk,
    from the middle of the step, as B and W -- ``split_probe`` Ws right after their B, the others deferred
    past the next microbatch's B (:mod:`primuspipe.passes.split_probe`) -- so a dump of a 1F1B run also
    times B and both kinds of W (warm and cold, ``compute.w_warm``) and ``primuspipe calibrate`` predicts
    split-backward schedules from it. Same gradients, bitwise; the step takes the split's small extra
    time. 0 (default): off."""

    auto_replan: bool = False
    """In-flight re-planning (docs/replanning.md): the first steps are measured (with a split-backward probe),
    rank 0 ranks every algorithm of the running layout under the measured costs and memory, and all ranks
    switch at a step boundary when the best is predicted faster by more than ``auto_replan_threshold``.
    Off by default."""
    auto_replan_warmup: int = 2
    """Training steps run before measuring (they are slow: allocator growth, lazy initialisation)."""
    auto_replan_steps: int = 3
    """Training steps measured for the decision."""
    auto_replan_threshold: float = 0.03
    """The predicted share of the step a switch must save."""
    auto_replan_memory_limit: float | None = None
    """Peak memory per rank (bytes) a new schedule may be predicted to use; default: the GPU's memory, no
    limit on CPU."""
    auto_replan_algorithms: str = ""
    """Comma-separated algorithms of the running layout to choose among (empty: all of them); without the
    configured algorithm among them the run always moves to the best of them after measuring."""
    auto_replan_verify: int = 3
    """Steps after the decision whose measured time is logged against the prediction (the median over them is
    the run's prediction error; more steps, less of one slow step in it)."""

    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where :func:`load_config` read each setting (``environment variable PRIMUSPIPE_X``, ``primuspipe config
    FILE``), so a value refused after it was read -- a range, a combination, an unknown algorithm -- is named
    with the variable or file to fix, not only the field."""

    @contextlib.contextmanager
    def _named_source(self, *names: str):
        """Re-raise a refusal with the source (:attr:`sources`) of the setting it is about: ``names`` (the
        field itself when it was set in code), or else the settings its message names."""
        try:
            yield
        except PrimusPipeError as exc:
            text = str(exc)
            about = names or [n for n in self.sources if re.search(rf"\b{n}\b", text)]
            where = list(dict.fromkeys(self.sources.get(n, n) for n in about if n in self.sources or names))
            if not where or any(w in text for w in where):
                raise
            message = f"{', '.join(where)}: {text}"
            try:
                error = type(exc)(message)
            except TypeError:  # an error whose constructor takes more than the message
                error = ConfigError(message)
            raise error from None

    def replan_settings(self) -> ReplanSettings:
        """These settings as the re-planner takes them."""
        return ReplanSettings(self.auto_replan, self.auto_replan_warmup, self.auto_replan_steps,
                              threshold=self.auto_replan_threshold, memory_limit_bytes=self.auto_replan_memory_limit,
                              verify_steps=self.auto_replan_verify, algorithms=self.auto_replan_algorithms or None)

    def __post_init__(self) -> None:
        """Check every field now, so a bad setting fails at :func:`install`, not on every rank at step 1."""
        with self._named_source():
            self._check_values()

    def _check_values(self) -> None:
        for name in _FLAGS:  # kept as read: install(offload="off") was kept as the text, which is truthy (on)
            object.__setattr__(self, name, strict.flag(getattr(self, name), name))
        strict.text(self.dump_dir, "dump_dir")
        strict.text(self.pp_algorithm, "pp_algorithm")
        if not isinstance(self.algorithm_options, Mapping):
            raise ConfigError(f"algorithm_options must be a mapping, got {strict.show(self.algorithm_options)}")
        object.__setattr__(self, "algorithm_options", MappingProxyType(dict(self.algorithm_options)))
        for name in ("pp_cost_f", "pp_cost_b", "pp_cost_w"):  # lists as tuples: the config stays a hashable value
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, value := tuple(value))
            if isinstance(value, tuple):
                if not value:  # would be refused on every rank at the first step, for every pp
                    raise ConfigError(f"{name}: an empty list gives no stage a time; give one number, or one per "
                                      "pipeline stage")
                for i, v in enumerate(value):
                    strict.number(v, f"{name}[{i}]", minimum=0)
            elif value is not None:
                strict.number(value, name, minimum=0)
        object.__setattr__(self, "watchdog_timeout_s", strict.number(
            self.watchdog_timeout_s, "watchdog_timeout_s (seconds; 0 disables the watchdog)", minimum=0,
            maximum=MAX_TIMEOUT_S))
        object.__setattr__(self, "split_probe", strict.count(self.split_probe, "split_probe (microbatches)", minimum=0))
        for name, check in _REPLAN_CHECKS.items():  # named as set here, then checked again as settings
            object.__setattr__(self, name, check(getattr(self, name), name))
        with self._named_source("auto_replan_algorithms"):  # its messages say "auto_replan algorithms"
            self.replan_settings()  # checks the rest (auto_replan, auto_replan_algorithms)
        if self.communication_method == BATCH_P2P:
            raise ConfigError("communication_method: batch_p2p is not supported: the runner posts each transfer as "
                              "its own non-blocking send/receive, the order its deadlock proof relies on; use "
                              f"{ASYNC_P2P!r} (the same transfers, unbatched)")
        if self.communication_method != ASYNC_P2P:
            raise ConfigError(f"communication_method must be {ASYNC_P2P!r}, got {self.communication_method!r}")
        if isinstance(self.offload_ops, (list, tuple)) and all(isinstance(op, str) for op in self.offload_ops):
            object.__setattr__(self, "offload_ops", ",".join(self.offload_ops))  # YAML's list of names
        if not isinstance(self.offload_ops, str):
            raise ConfigError(f"offload_ops must be op names (comma-separated text or a list), got "
                              f"{strict.show(self.offload_ops)}; known: {', '.join(OFFLOAD_OPS)}")
        if unknown := sorted(set(self.offload_op_list) - set(OFFLOAD_OPS)):
            raise ConfigError(f"offload_ops: unknown op(s) {unknown}{strict.did_you_mean(unknown[0], OFFLOAD_OPS)}; "
                              f"known: {', '.join(OFFLOAD_OPS)}")
        if self.offload_fraction is not None:
            share = strict.number(self.offload_fraction, "offload_fraction (share of a chunk's activations, in (0, 1])",
                                  above=0, maximum=1)
            object.__setattr__(self, "offload_fraction", share)
        if self.offload and self.pp_max_mem is None:
            raise ConfigError("offload: true needs pp_max_mem, the activation limit (microbatches per rank) the "
                              "offload pass brings every rank under; set it, or offload: false")
        if self.offload and self.offload_op_list and self.offload_fraction is None:
            raise ConfigError(f"offload_ops: {self.offload_ops} moves only part of each chunk's activations, and the "
                              "offload pass must know which share to plan with: set offload_fraction (e.g. 0.3; a run "
                              "logs the measured share), or leave offload_ops empty to move everything")
        cost = self.algorithm_options.get("cost")
        # anything else was refused only at every rank's first step (a list as a TypeError), not at install()
        if cost is not None and not isinstance(cost, (str, os.PathLike, Mapping, CostModel)):
            raise ConfigError(f"algorithm_options.cost must be a cost file's path or its mapping (docs/simulator.md, "
                              f"'Cost model'), got {strict.show(cost)}")
        if isinstance(cost, (str, os.PathLike)):  # a cost file's path
            with self._named_source("algorithm_options"):
                object.__setattr__(self, "algorithm_options",
                                   MappingProxyType({**self.algorithm_options, "cost": read_cost_file(cost)}))
        if "costs" in self.algorithm_options:
            raise ConfigError("algorithm_options.costs is gone: give pp_cost_f, pp_cost_b, pp_cost_w (and pp_max_mem), "
                              "or algorithm_options.cost as a cost-file mapping (docs/simulator.md)")
        if self.algorithm_options.get("cost") is not None and self.has_primus_costs:
            raise ConfigError("give the costs once: either pp_cost_f/b/w or algorithm_options.cost")
        if self.pp_max_mem is not None and "memory_limit" in self.algorithm_options:
            raise ConfigError("give the memory limit once: either pp_max_mem or algorithm_options.memory_limit")
        if self.pp_max_mem is not None:
            if isinstance(self.pp_max_mem, (list, tuple)):
                raise ConfigError(f"pp_max_mem: primuspipe bounds every rank by one limit, got the list {self.pp_max_mem}; "
                                  "give one number (the smallest of yours keeps every rank within its own)")
            if isinstance(self.pp_max_mem, bool) or not isinstance(self.pp_max_mem, (int, float)) or \
                    not math.isfinite(self.pp_max_mem) or self.pp_max_mem < 0:
                raise ConfigError(f"pp_max_mem must be >= 0 and finite (microbatches), got {strict.show(self.pp_max_mem)}")
            if self.pp_max_mem <= 0:
                raise ConfigError(f"pp_max_mem must be > 0 microbatches, got {self.pp_max_mem}")

    def check(self) -> None:
        """What :func:`install` checks beyond the values: the algorithm exists and takes the options (the
        cost model and memory limit are ``build_schedule``'s, not the algorithm's), and the dump directory
        can be written (it is created)."""
        from primuspipe.algorithms.build import check_options
        from primuspipe.algorithms.registry import get_algorithm

        options = {k: v for k, v in self.algorithm_options.items() if k not in _SCHEDULE_KEYWORDS}
        for algorithm in self.algorithms():
            with self._named_source("pp_algorithm"):
                get_algorithm(algorithm)
            with self._named_source("algorithm_options"):
                check_options(algorithm, options)
                _trial_build(algorithm, options)
        with self._named_source("algorithm_options"):
            if "memory_limit" in self.algorithm_options:
                strict.number(self.algorithm_options["memory_limit"], "algorithm_options.memory_limit", above=0)
            if isinstance(cost := self.algorithm_options.get("cost"), Mapping):
                _check_cost_mapping(cost)
        if self.dump_pp_data:
            with self._named_source("dump_dir"):
                strict.writable_folder(self.dump_dir, f"dump_dir {self.dump_dir}")

    def algorithms(self) -> tuple[str, ...]:
        """The algorithms this config may run: the named one, or both of ``auto``'s (options given with
        ``auto`` are for interleaved-1f1b only, the one that takes any)."""
        return ("interleaved-1f1b",) if self.pp_algorithm == AUTO else (self.pp_algorithm,)

    @property
    def offload_op_list(self) -> tuple[str, ...]:
        return tuple(op.strip() for op in str(self.offload_ops).split(",") if op.strip())

    @property
    def has_primus_costs(self) -> bool:
        return any(v is not None for v in (self.pp_cost_f, self.pp_cost_b, self.pp_cost_w))
    def schedule_options(self, pp: int, vpp: int) -> dict[str, Any]:
        """The keyword arguments of ``build_schedule`` for a ``pp`` x ``vpp`` pipeline: the algorithm's
        options, plus ``cost`` (from ``pp_cost_f/b/w``, or ``algorithm_options.cost`` in the cost-file
        form) and ``memory_limit`` (from ``pp_max_mem``) when given.

        >>> PrimusPipeConfig(pp_cost_f=1, pp_cost_b=2, pp_cost_w=1).schedule_options(2, 1)["cost"].compute.backward_input
        (2.0, 2.0)
        """
        options = dict(self.algorithm_options)
        memory = MemoryCost(w_retained_fraction=1.0) if self.pp_max_mem is not None else MemoryCost()
        if isinstance(options.get("cost"), Mapping):
            options["cost"] = CostModel.from_dict(options["cost"], pp=pp, vpp=vpp)
        elif self.has_primus_costs or self.pp_max_mem is not None:
            f, b, w = (per_stage_values(name, PRIMUS_DEFAULT_COST if value is None else value, pp, "pipeline stages")
                       for name, value in (("pp_cost_f", self.pp_cost_f), ("pp_cost_b", self.pp_cost_b),
                                           ("pp_cost_w", self.pp_cost_w)))
            options["cost"] = CostModel.per_stage(pp, f, b, w, memory=memory)
        if self.pp_max_mem is not None and not self.offload:
            options["memory_limit"] = float(self.pp_max_mem)
        return options

    def offload_plan(self, pp: int, vpp: int) -> tuple[CostModel, float] | None:
        """With ``offload``: the cost model and the limit the offload pass plans the table with.

        >>> cost, limit = PrimusPipeConfig(offload=True, pp_max_mem=1.5).offload_plan(2, 2)
        >>> limit, cost.memory.offload_fraction, cost.memory.w_retained_fraction
        (1.5, 1.0, 1.0)
        """
        if not self.offload:
            return None
        cost = self.schedule_options(pp, vpp)["cost"]
        if self.offload_fraction is not None:
            cost = replace(cost, memory=replace(cost.memory, offload_fraction=float(self.offload_fraction)))
        return cost, float(self.pp_max_mem)

    @property
    def offload_modules(self) -> tuple[str, ...]:
        """The submodule name parts the runner offloads (empty: everything a chunk saves)."""
        return tuple(dict.fromkeys(m for op in self.offload_op_list for m in OFFLOAD_OPS[op]))

    def algorithm_for(self, vpp: int) -> str:
        if self.pp_algorithm == AUTO:
            return "1f1b" if vpp == 1 else "interleaved-1f1b"
        return self.pp_algorithm


ENV_PREFIX = "PRIMUSPIPE_"
_ENV_NAMES = {
    "patch_primus_pipeline": "PRIMUSPIPE_PATCH",
    "pp_algorithm": "PRIMUSPIPE_PP_ALGORITHM",
    "algorithm_options": "PRIMUSPIPE_ALGORITHM_OPTIONS",
    "dump_pp_data": "PRIMUSPIPE_DUMP_PP_DATA",
    "dump_dir": "PRIMUSPIPE_DUMP_DIR",
    "watchdog_timeout_s": "PRIMUSPIPE_WATCHDOG_TIMEOUT_S",
    "communication_method": "PRIMUSPIPE_COMMUNICATION_METHOD",
    "debug_scheduler_table": "PRIMUSPIPE_DEBUG_SCHEDULER_TABLE",
    "offload": "PRIMUSPIPE_OFFLOAD",
    "offload_ops": "PRIMUSPIPE_OFFLOAD_OPS",
    "offload_fraction": "PRIMUSPIPE_OFFLOAD_FRACTION",
    "pp_cost_f": "PRIMUSPIPE_PP_COST_F",
    "pp_cost_b": "PRIMUSPIPE_PP_COST_B",
    "pp_cost_w": "PRIMUSPIPE_PP_COST_W",
    "pp_max_mem": "PRIMUSPIPE_PP_MAX_MEM",
    "split_probe": "PRIMUSPIPE_SPLIT_PROBE",
    "auto_replan": REPLAN_ENV_NAMES["enabled"],
    "auto_replan_warmup": REPLAN_ENV_NAMES["warmup_steps"],
    "auto_replan_steps": REPLAN_ENV_NAMES["measure_steps"],
    "auto_replan_threshold": REPLAN_ENV_NAMES["threshold"],
    "auto_replan_memory_limit": REPLAN_ENV_NAMES["memory_limit_bytes"],
    "auto_replan_algorithms": REPLAN_ENV_NAMES["algorithms"],
    "auto_replan_verify": REPLAN_ENV_NAMES["verify_steps"],
}
SETTINGS = tuple(_ENV_NAMES)
"""The settings a config file, ``install()``'s keywords and the environment may give (all but ``sources``)."""
_FLAGS = ("patch_primus_pipeline", "dump_pp_data", "debug_scheduler_table", "offload", "auto_replan")
"""The switches: each kept as a bool (:func:`strict.flag` reads text the environment gives)."""
_REPLAN_CHECKS = {
    **{key: lambda value, what, field=field: checked_setting(field, value, what, text=True)
       for key, field in (("auto_replan_warmup", "warmup_steps"), ("auto_replan_steps", "measure_steps"),
                          ("auto_replan_verify", "verify_steps"), ("auto_replan_threshold", "threshold"))},
    "auto_replan_memory_limit": lambda value, what: None if value is None else memory_limit(value, what),
}
"""The ``auto_replan_*`` numbers, each checked with :class:`ReplanSettings`' bounds under the name the config (or
its variable) gives it, so a refusal names the setting as the user wrote it."""
_SCHEDULE_KEYWORDS = ("cost", "memory_limit")
"""``algorithm_options`` keys that go to ``build_schedule`` itself, not to the algorithm."""
OTHER_VARIABLES = frozenset({"PRIMUSPIPE_CONFIG", "PRIMUSPIPE_DEMO_DIR", "PRIMUSPIPE_NCCL_EMULATION"})
"""``PRIMUSPIPE_*`` variables that are not settings: the config file, and scripts/demo.sh's output folder.
Any other ``PRIMUSPIPE_*`` variable is refused as a misspelling (an unknown YAML key is refused too)."""


def _coerce(name: str, value: Any, source: str) -> Any:
    """One setting from YAML (typed) or the environment (text), checked strictly."""
    what = f"{source}: {name}"
    if name in _REPLAN_CHECKS:
        return _REPLAN_CHECKS[name](value, what)
    kind = {f.name: f.type for f in fields(PrimusPipeConfig)}[name]
    if value is None and ("None" in kind or kind == "Any"):
        return None
    if kind in ("Any", "float | None"):  # a number or (Any) a list of numbers; JSON in the environment
        text = value
        try:
            value = strict.load_json(text, what) if isinstance(text, str) else text
        except ConfigError:
            value = text
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, list))):
            raise ConfigError(f"{source}: bad value for {name}: {strict.show(text)} is not a number or a list of "
                              "numbers (JSON in the environment, e.g. 1.5 or [1, 2])")
        return value
    if kind == "bool":
        return strict.flag(value, what)
    if kind == "float":
        return strict.number(value, what, minimum=0)
    if kind == "int":
        return strict.count(value, what, text=True)
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{what} must be text, got {strict.show(value)}")
        return value
    if isinstance(value, str):
        value = strict.load_json(value, what) if value.strip() else {}
    return strict.keys(value, what, allowed=value.keys() if isinstance(value, Mapping) else ())


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> PrimusPipeConfig:
    """Read the YAML file (``path`` or ``$PRIMUSPIPE_CONFIG``), then apply environment overrides.

    Everything goes through :mod:`primuspipe.strict`: a bounded file, no YAML aliases (no alias
    bomb), known keys only, finite numbers; an unknown ``PRIMUSPIPE_*`` variable is named with the
    closest known one."""
    env = os.environ if env is None else env
    known = set(_ENV_NAMES.values()) | OTHER_VARIABLES
    for var in sorted(env):
        if var.upper().startswith(ENV_PREFIX) and var not in known:  # primuspipe_patch too: names are case-sensitive
            near = strict.closest(var.upper(), known)
            raise ConfigError(f"environment variable {var} is not a primuspipe setting"
                              + (f" (did you mean {near}?)" if near else "")
                              + f"; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    what = "primuspipe config" if path is not None else "primuspipe config (PRIMUSPIPE_CONFIG)"
    path = path if path is not None else env.get("PRIMUSPIPE_CONFIG")
    if path is not None and path != "":  # an empty PRIMUSPIPE_CONFIG is none; [] or 0 is no path
        source = f"primuspipe config {path}"
        data = strict.load_yaml(strict.read_text(path, what), source)
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
        data = strict.keys(data, source, allowed=_ENV_NAMES)
        values.update({k: _coerce(k, v, source) for k, v in data.items()})
        sources.update(dict.fromkeys(data, source))
    for name, var in _ENV_NAMES.items():
        if var in env:
            sources[name] = f"environment variable {var}"
            values[name] = _coerce(name, env[var], sources[name])
    return replace(PrimusPipeConfig(), **values, sources=sources)


def _trial_build(algorithm: str, options: dict[str, Any]) -> None:
    """Build ``algorithm`` with ``options`` on a small shape they all fit (pp 2, microbatches twice the
    largest integer option), so an option value no shape takes (``microbatch_group_size: 0``) is
    refused at install rather than on every rank at the first step."""
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.errors import ScheduleShapeError

    sizes = [v for v in options.values() if isinstance(v, int) and not isinstance(v, bool)]
    try:
        build_schedule(algorithm, 2, 2 * max([2, *sizes]), communication=False, **options)
    except (ScheduleShapeError, ConfigError) as exc:
        raise ConfigError(f"algorithm_options {dict(options)} for {algorithm}: {exc}") from None


def _check_cost_mapping(cost: Mapping) -> None:
    """``algorithm_options.cost`` read as the cost model it will be at the first step (per-stage lists
    taken at their own length), so a bad key or value fails at install."""
    lengths = [len(v) for section in cost.values() if isinstance(section, Mapping)
               for v in section.values() if isinstance(v, (list, tuple))]
    try:
        CostModel.from_dict(cost, pp=max(lengths, default=1), vpp=1, source="algorithm_options.cost")
    except PrimusPipeError as exc:
        raise ConfigError(str(exc)) from None

