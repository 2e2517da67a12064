"""Algorithms are registered by name; outside packages add theirs through an entry point.

An algorithm is a pure function ``fn(request: ScheduleRequest, **options) -> ScheduleTable`` returning
a compute-only table. Options are its keyword-only parameters (with defaults), which ``primuspipe list``
shows and the CLI/config pass through. Registering a taken name raises, so two plug-ins can never
silently shadow each other.

Third-party packages declare, in their packaging metadata::

    [project.entry-points."primuspipe.algorithms"]
    my-schedule = "my_package.schedules"      # importing the module registers its algorithms
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

from primuspipe.algorithms.aliases import ALIASES, BY_NAME, Alias
from primuspipe import strict
from primuspipe.ir.activations import peak_in_flight
from primuspipe.ir.cost_model import CostModel, MemoryCost
from primuspipe.ir.placement import Placement
from primuspipe.errors import ConfigError, DuplicateAlgorithmError, PrimusPipeError, UnknownAlgorithmError
from primuspipe.ir.table import ScheduleTable

ENTRY_POINT_GROUP = "primuspipe.algorithms"

BUILTIN_MODULES = (
    "primuspipe.algorithms.classic",
    "primuspipe.algorithms.zero_bubble",
    "primuspipe.algorithms.vshape",
    "primuspipe.algorithms.dualpipe_v",
    "primuspipe.search.zb_auto",
)
"""Modules whose import registers the built-in algorithms, loaded on first look-up like plug-ins."""


@dataclass(frozen=True)
class ScheduleRequest:
    """The shape an algorithm is asked to schedule, plus what cost-aware algorithms may use."""

    pp: int
    vpp: int | None
    """Chunks per rank; None only for an algorithm that chooses its placement (``zb-auto``)."""
    microbatches: int
    cost: CostModel | None = None
    """The cost model the table will be judged by (the simulator's: per-stage times, P2P, what W keeps
    of the activations); None means F = B = W = 1 per 1F1B stage, free P2P, the default memory model."""
    memory_limit: float | None = None
    """Per-rank bound on activations held, in microbatches of one 1F1B stage, each counted from its F
    until its W (docs/design.md §4); None means unbounded."""
    memory_limit_bytes: tuple[float, ...] | float | None = None
    """Per rank (one number: every rank): the activation bytes a table may hold at its peak, counted as the
    simulator's byte peak counts them (:meth:`~primuspipe.ir.cost_parts.MemoryCost.peak_bytes`: a B's rise and
    what W keeps beyond the retained share included); needs a cost model with activation bytes. None means
    unbounded."""

    def __post_init__(self) -> None:
        if self.memory_limit_bytes is None:
            return
        limits = self.memory_limit_bytes
        limits = (limits,) * self.pp if isinstance(limits, (numbers.Real, str)) else tuple(limits)
        if len(limits) != self.pp:
            raise ConfigError(f"memory_limit_bytes needs one number per rank ({self.pp}) or one for all, got "
                              f"{strict.show(limits)}")
        limits = tuple(strict.number(x, f"memory_limit_bytes[{r}]", minimum=0) for r, x in enumerate(limits))
        if self.cost is None or not self.cost.memory.models_bytes:
            raise ConfigError("memory_limit_bytes needs a cost model with activation bytes (memory.activation_bytes) "
                              "to count a table's bytes; give one, or a limit in microbatches (memory_limit)")
        object.__setattr__(self, "memory_limit_bytes", limits)

    def cost_model(self, vpp: int | None = None) -> CostModel:
        """The cost model for ``pp * vpp`` stages (the request's vpp by default), re-cut from the given
        one (:meth:`~primuspipe.ir.cost_model.CostModel.for_shape`) or the unit model."""
        vpp = vpp or self.vpp
        assert vpp is not None, "an algorithm that chooses its placement must name the vpp it costs"
        return (self.cost or CostModel.per_stage(self.pp, 1.0, 1.0, 1.0)).for_shape(self.pp, vpp)

    def fits(self, table: ScheduleTable) -> bool:
        """Whether ``table`` (a compute table of this request's shape) keeps within both memory limits, each by
        the one activation counter: microbatch units, and bytes as the simulator counts them."""
        if self.memory_limit is not None and max(peak_in_flight(table, self.retained)) > self.memory_limit + 1e-9:
            return False
        if self.memory_limit_bytes is None:
            return True
        peaks = self.cost_model(table.vpp).memory.peak_bytes(table)
        return all(peak <= limit * (1 + 1e-9) for peak, limit in zip(peaks, self.memory_limit_bytes))

    def chunk_cap(self, placement: Placement) -> tuple[float | None, float | None]:
        """The memory limits as caps on chunk activations per rank in the unit count constructions use
        (``w_retained_fraction`` until W): ``(sure, loose)`` -- within ``sure`` a table fits both limits, and no
        table above ``loose`` fits (:meth:`~primuspipe.ir.cost_parts.MemoryCost.chunk_caps`); None: unbounded
        (a limit of 1e308 microbatches times vpp chunks is no number: it bounds nothing)."""
        units = math.inf if self.memory_limit is None else self.memory_limit * placement.vpp
        sure = loose = units
        if self.memory_limit_bytes is not None:
            sure, loose = self.cost_model(placement.vpp).memory.chunk_caps(placement, self.memory_limit_bytes)
            sure, loose = min(sure, units), min(loose, units)
        return tuple(None if math.isinf(cap) else cap for cap in (sure, loose))  # type: ignore[return-value]

    @property
    def retained(self) -> float:
        """Share of a microbatch's activations its B keeps for its W, from the cost model."""
        return (self.cost.memory if self.cost is not None else MemoryCost()).w_retained_fraction


Builder = Callable[..., ScheduleTable]


@dataclass(frozen=True)
class AlgorithmInfo:
    name: str
    build: Builder
    placement: str
    """Built-in placement the algorithm uses: "interleaved" or "v", or "any" for one that chooses it
    (and its vpp, unless the caller gives one)."""
    vpp: int | None
    """The vpp the algorithm requires, or None if it takes any."""
    split_backward: bool
    """True if its tables may use separate B and W nodes (needs a runner that can split weight grads); one
    registered False that returns such a table is refused (``build.compute_table``). True allows a fused table
    too: ``zb-auto`` may pick a 1F1B construction."""
    default_vpp: int = 1
    """The vpp used when the caller gives none and the algorithm takes any."""
    preset: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Options fixed by the name it was looked up by (an alias, :mod:`primuspipe.algorithms.aliases`)."""
    alias_of: str | None = None
    """The registered algorithm an alias runs; None for a registered name."""

    def resolve_vpp(self, vpp: int | None) -> int | None:
        """The vpp to build with: the caller's, else the required one, else the default (None for an
        algorithm that chooses its placement)."""
        if vpp is not None or self.vpp is not None:
            return vpp if vpp is not None else self.vpp
        return None if self.placement == "any" else self.default_vpp

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.build) or "").split("\n")[0]

    def options(self) -> list[inspect.Parameter]:
        return [p for p in inspect.signature(self.build).parameters.values()
                if p.kind is p.KEYWORD_ONLY and p.name not in self.preset]

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` checked against the algorithm's keyword parameters: known names (an unknown one is
        named with the closest known), values of the annotated type (``int``, ``float``, ``bool``, ``str``,
        ``None`` and unions of them; a finite number for ``float``). Raises :class:`ConfigError`."""
        params = {p.name: p for p in self.options()}
        try:
            hints = typing.get_type_hints(self.build)
        except Exception:  # noqa: BLE001 - a plug-in's annotations may not resolve; its defaults still guide
            hints = {}
        for name, value in options.items():
            if name not in params:
                raise ConfigError(f"{self.name} has no option {name!r}{strict.did_you_mean(name, params)}; "
                                  f"its options are {sorted(params) or 'none'}")
            default = params[name].default
            annotation = hints.get(name, type(default) if default is not inspect.Parameter.empty else None)
            if annotation is not None:
                strict.of_type(value, annotation, f"{self.name} option {name}")
        return dict(options)


_REGISTRY: dict[str, AlgorithmInfo] = {}
_plugins_loaded = False
_builtins_loaded = False


def register(
    name: str, *, placement: str = "interleaved", vpp: int | None = None, split_backward: bool = False,
    default_vpp: int = 1,
):
    """Decorator registering ``fn`` under ``name``; a name can be registered once. The arguments are checked
    here, where the plug-in's author reads the message (:func:`_check_registration`), not when a user runs it."""
    _check_registration(name, placement, vpp, split_backward, default_vpp)

    def wrap(fn: Builder) -> Builder:
        _check_function(name, fn)
        if fn.__module__ not in BUILTIN_MODULES:
            _load_builtins()  # a user's name must meet the built-in names even before any look-up
        if name in BY_NAME:
            raise DuplicateAlgorithmError(f"{name!r} is {BY_NAME[name].origin}'s name for {BY_NAME[name].target!r}; "
                                          "pick another name")
        if name in _REGISTRY:
            raise DuplicateAlgorithmError(
                f"algorithm {name!r} is already registered by {_REGISTRY[name].build.__module__}; pick another name"
            )
        _REGISTRY[name] = AlgorithmInfo(name, fn, placement, vpp, split_backward, default_vpp)
        return fn

    return wrap


PLACEMENTS = ("interleaved", "v", "any")
RESERVED_NAMES = ("all",)
"""Words the command line reads itself (``simulate -a all``): an algorithm of that name could not be picked."""


def _check_registration(name: Any, placement: Any, vpp: Any, split_backward: Any, default_vpp: Any) -> None:
    """:func:`register`'s arguments: a name the command line can pass and print (no blank, control character or
    leading dash, not a word it reads itself), a built-in placement, a vpp that placement can hold, a flag that is
    a boolean. Each was accepted as given: ``register(5)`` broke ``primuspipe list`` (a TypeError), ``"all"``
    could never be picked alone, ``vpp="2"`` failed at the first build, ``split_backward="no"`` read as true."""
    who = f"register({strict.show(name)})"
    if not isinstance(name, str) or not name or not name.isprintable() or any(c.isspace() for c in name) \
            or name.startswith("-") or name in RESERVED_NAMES:
        raise ConfigError(f"{who}: an algorithm's name must be non-empty text without blanks or control characters, "
                          f"not starting with '-' and not {', '.join(map(repr, RESERVED_NAMES))}; pick another name")
    strict.text(placement, f"{who}: placement", choices=PLACEMENTS)
    if vpp is not None:
        strict.count(vpp, f"{who}: vpp", minimum=1)
    strict.count(default_vpp, f"{who}: default_vpp", minimum=1)
    if placement == "v" and vpp != 2:
        raise ConfigError(f"{who}: the V-shape placement holds 2 chunks per rank; give vpp=2, got {strict.show(vpp)}")
    if not isinstance(split_backward, bool):
        raise ConfigError(f"{who}: split_backward must be true or false, got {strict.show(split_backward)}")


def _check_function(name: str, fn: Any) -> None:
    """What :func:`~primuspipe.algorithms.build.build_schedule` will call: a function of the request whose other
    parameters are keyword-only options with defaults (a required option or a second positional parameter was a
    TypeError at every build)."""
    who = f"algorithm {name!r}"
    if not callable(fn):
        raise ConfigError(f"{who}: register() decorates a function of the request, got {type(fn).__name__}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin or C callable: its signature cannot be read, only called
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if not positional or any(p.default is p.empty and p.kind is not p.VAR_POSITIONAL for p in positional[1:]):
        raise ConfigError(f"{who} ({getattr(fn, '__module__', '?')}): the function must take the request as its one "
                          "positional parameter, fn(request, *, option=default, ...)")
    if required := [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]:
        raise ConfigError(f"{who} ({getattr(fn, '__module__', '?')}): option {required[0]!r} has no default; every "
                          "option needs one (primuspipe builds with none given)")


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    _load_builtins()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except PrimusPipeError:
            raise
        except Exception as exc:  # a broken plug-in must say which one it is
            raise PrimusPipeError(f"loading algorithm plug-in {ep.name!r} ({ep.value}) failed: {exc}") from exc


def get_algorithm(name: str) -> AlgorithmInfo:
    """The algorithm registered as ``name``, or the one an alias (another framework's name) runs."""
    _load_plugins()
    if name in BY_NAME:
        return _resolve(BY_NAME[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownAlgorithmError(
            f"no algorithm named {name!r}; registered: {', '.join(sorted(_REGISTRY))}; "
            f"aliases: {', '.join(sorted(BY_NAME))}"
        ) from None


def _resolve(alias: Alias) -> AlgorithmInfo:
    target = _REGISTRY[alias.target]
    return AlgorithmInfo(alias.name, target.build, alias.placement or target.placement,
                         alias.vpp if alias.vpp is not None else target.vpp, target.split_backward,
                         target.default_vpp, alias.options, alias.target)


def list_algorithms() -> list[AlgorithmInfo]:
    """The registered algorithms, by name (aliases are :func:`list_aliases`)."""
    _load_plugins()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def list_aliases() -> tuple[Alias, ...]:
    """Other frameworks' names for registered algorithms (:mod:`primuspipe.algorithms.aliases`)."""
    return ALIASES
