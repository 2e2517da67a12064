"""What a user sets for in-flight re-planning, checked alike wherever it is given.

:class:`ReplanSettings` is one value whether it comes from the API (``TorchPipeline(auto_replan=...)``), the
``PRIMUSPIPE_AUTO_REPLAN*`` environment variables (:data:`ENV_NAMES`) or the Megatron config's keys
(:mod:`primuspipe.backends.megatron.config` reads them with :func:`checked_setting` and :func:`memory_limit`), so
a value is refused the same way, under the name the user gave it, before any step runs (docs/replanning.md).
What the settings steer -- measuring the first steps and choosing a table from them -- is
:mod:`~primuspipe.calibration.replan_decision`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from primuspipe.algorithms import get_algorithm
from primuspipe.calibration.replan_candidates import same_layout
from primuspipe.errors import ConfigError, PrimusPipeError, UnknownAlgorithmError
from primuspipe import strict
from primuspipe.ir.table import ScheduleTable


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


def check_settings_kind(value: Any) -> ReplanSettings:
    """``auto_replan`` as a backend option: True/False or :class:`ReplanSettings`."""
    if isinstance(value, ReplanSettings):
        return value
    if isinstance(value, bool):
        return ReplanSettings(enabled=value)
    raise ConfigError(f"auto_replan must be True, False or a ReplanSettings, got {strict.show(value)}")


__all__ = ["ENV_NAMES", "ReplanSettings", "check_settings_kind", "checked_setting", "memory_limit"]
