"""primuspipe's settings for Megatron: a typed dataclass read from YAML and/or environment variables.

Environment variables override the YAML file; ``PRIMUSPIPE_CONFIG`` names the YAML file when no path
is given. Every key (YAML name / environment variable):

=========================  ===============================  ==========================================
``patch_primus_pipeline``  ``PRIMUSPIPE_PATCH``             master switch; ``install`` does nothing when false
``pp_algorithm``           ``PRIMUSPIPE_PP_ALGORITHM``      algorithm name; ``auto`` = 1f1b / interleaved-1f1b
``algorithm_options``      ``PRIMUSPIPE_ALGORITHM_OPTIONS`` mapping of the algorithm's options (env: JSON)
``dump_pp_data``           ``PRIMUSPIPE_DUMP_PP_DATA``      write a timeline per rank and iteration
``dump_dir``               ``PRIMUSPIPE_DUMP_DIR``          where the timelines go
``watchdog_timeout_s``     ``PRIMUSPIPE_WATCHDOG_TIMEOUT_S`` hang watchdog; 0 turns it off
=========================  ===============================  ==========================================

>>> load_config(env={"PRIMUSPIPE_PATCH": "1", "PRIMUSPIPE_PP_ALGORITHM": "gpipe"}).pp_algorithm
'gpipe'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from primuspipe.errors import ConfigError
from primuspipe.ir import strict

AUTO = "auto"


@dataclass(frozen=True)
class PrimusPipeConfig:
    patch_primus_pipeline: bool = False
    """Master switch: replace Megatron's forward-backward function. Off unless asked for, so a config
    read from an empty environment leaves Megatron untouched."""
    pp_algorithm: str = AUTO
    """A registered algorithm (``primuspipe list``); ``auto`` picks Megatron's own choice: ``1f1b`` for
    vpp = 1, ``interleaved-1f1b`` for vpp > 1."""
    algorithm_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Keyword options of the algorithm, e.g. ``{"microbatch_group_size": 4}`` for interleaved-1f1b
    (with ``auto``, they are interleaved-1f1b's: 1f1b takes none). Without one, interleaved-1f1b follows
    Megatron's ``microbatch_group_size_per_vp_stage``. Checked against the algorithm at :func:`install`."""
    dump_pp_data: bool = False
    """Write each rank's per-node start/end times and peak memory for every training iteration."""
    dump_dir: str = "pp_data"
    """Directory of the dumps (``iter_<n>/rank_<r>.json``, primuspipe timeline format)."""
    watchdog_timeout_s: float = 300.0
    """A send or receive not complete this long after it was posted raises PipelineHangError naming the
    rank, node, peer and the ranks that stopped beating; 0 disables the watchdog. It never blocks the host
    on NCCL (a monitor thread watches; see runtime/transport.py)."""

    def __post_init__(self) -> None:
        """Check every field now, so a bad setting fails at :func:`install`, not on every rank at step 1."""
        strict.flag(self.patch_primus_pipeline, "patch_primus_pipeline")
        strict.flag(self.dump_pp_data, "dump_pp_data")
        strict.text(self.pp_algorithm, "pp_algorithm")
        if not isinstance(self.algorithm_options, Mapping):
            raise ConfigError(f"algorithm_options must be a mapping, got {strict.show(self.algorithm_options)}")
        object.__setattr__(self, "algorithm_options", MappingProxyType(dict(self.algorithm_options)))
        object.__setattr__(self, "watchdog_timeout_s", strict.number(
            self.watchdog_timeout_s, "watchdog_timeout_s (seconds; 0 disables the watchdog)", minimum=0))
        if self.dump_pp_data:
            strict.text(self.dump_dir, "dump_dir (needed with dump_pp_data)")

    def check(self) -> None:
        """What :func:`install` checks beyond the values: the algorithm exists and takes the options, and
        the dump directory can be written (it is created)."""
        from primuspipe.algorithms.build import check_options

        for algorithm in self.algorithms():
            check_options(algorithm, dict(self.algorithm_options))
        if self.dump_pp_data:
            folder = Path(self.dump_dir)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"dump_dir {self.dump_dir}: cannot create it ({exc.strerror or exc}); "
                                  "give a writable directory") from None
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ConfigError(f"dump_dir {self.dump_dir}: permission denied; give a writable directory")

    def algorithms(self) -> tuple[str, ...]:
        """The algorithms this config may run: the named one, or both of ``auto``'s (options given with
        ``auto`` are for interleaved-1f1b only, the one that takes any)."""
        return ("interleaved-1f1b",) if self.pp_algorithm == AUTO else (self.pp_algorithm,)

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
}
OTHER_VARIABLES = frozenset({"PRIMUSPIPE_CONFIG", "PRIMUSPIPE_DEMO_DIR"})
"""``PRIMUSPIPE_*`` variables that are not settings: the config file, and scripts/demo.sh's output folder.
Any other ``PRIMUSPIPE_*`` variable is refused as a misspelling (an unknown YAML key is refused too)."""


def _coerce(name: str, value: Any, source: str) -> Any:
    """One setting from YAML (typed) or the environment (text), checked strictly."""
    what = f"{source}: {name}"
    kind = {f.name: f.type for f in fields(PrimusPipeConfig)}[name]
    if kind == "bool":
        return strict.flag(value, what)
    if kind == "float":
        return strict.number(value, what, minimum=0)
    if kind == "str":
        return strict.text(value, what)
    if isinstance(value, str):
        value = strict.load_json(value, what) if value.strip() else {}
    return strict.keys(value, what, allowed=value.keys() if isinstance(value, Mapping) else ())


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> PrimusPipeConfig:
    """Read the YAML file (``path`` or ``$PRIMUSPIPE_CONFIG``), then apply environment overrides.

    Everything goes through :mod:`primuspipe.ir.strict`: a bounded file, no YAML aliases (no alias
    bomb), known keys only, finite numbers; an unknown ``PRIMUSPIPE_*`` variable is named with the
    closest known one."""
    env = os.environ if env is None else env
    known = set(_ENV_NAMES.values()) | OTHER_VARIABLES
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in known:
            near = strict.closest(var, known)
            raise ConfigError(f"environment variable {var} is not a primuspipe setting"
                              + (f" (did you mean {near}?)" if near else "")
                              + f"; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    path = path if path is not None else env.get("PRIMUSPIPE_CONFIG")
    if path:
        source = f"primuspipe config {path}"
        data = strict.keys(strict.load_yaml(strict.read_text(path, "primuspipe config"), source), source,
                           allowed=_ENV_NAMES)
        values.update({k: _coerce(k, v, source) for k, v in data.items()})
    for name, var in _ENV_NAMES.items():
        if var in env:
            values[name] = _coerce(name, env[var], f"environment variable {var}")
    return replace(PrimusPipeConfig(), **values)
