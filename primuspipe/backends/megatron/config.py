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

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from primuspipe.errors import ConfigError

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
    """Keyword options of the algorithm, e.g. ``{"microbatch_group_size": 4}`` for interleaved-1f1b.
    Without one, interleaved-1f1b follows Megatron's ``microbatch_group_size_per_vp_stage``."""
    dump_pp_data: bool = False
    """Write each rank's per-node start/end times and peak memory for every training iteration."""
    dump_dir: str = "pp_data"
    """Directory of the dumps (``iter_<n>/rank_<r>.json``, primuspipe timeline format)."""
    watchdog_timeout_s: float = 300.0
    """A send or receive not complete this long after it was posted raises PipelineHangError naming the
    rank, node, peer and the ranks that stopped beating; 0 disables the watchdog. It never blocks the host
    on NCCL (a monitor thread watches; see runtime/transport.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.pp_algorithm, str) or not self.pp_algorithm:
            raise ConfigError(f"pp_algorithm must be an algorithm name, got {self.pp_algorithm!r}")
        if not isinstance(self.algorithm_options, Mapping):
            raise ConfigError(f"algorithm_options must be a mapping, got {type(self.algorithm_options).__name__}")
        object.__setattr__(self, "algorithm_options", MappingProxyType(dict(self.algorithm_options)))
        if self.watchdog_timeout_s < 0:
            raise ConfigError(f"watchdog_timeout_s must be >= 0 (0 disables it), got {self.watchdog_timeout_s}")

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
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = {f.name: f.type for f in fields(PrimusPipeConfig)}[name]
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError(f"not a boolean: {value!r}")
        if kind == "float":
            return float(value)
        if kind == "str":
            return str(value)
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if not isinstance(value, Mapping):
            raise ValueError(f"not a mapping: {value!r}")
        return dict(value)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{source}: bad value for {name}: {exc}") from exc


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> PrimusPipeConfig:
    """Read the YAML file (``path`` or ``$PRIMUSPIPE_CONFIG``), then apply environment overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = path if path is not None else env.get("PRIMUSPIPE_CONFIG")
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read primuspipe config {path}: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        if unknown := set(data) - set(_ENV_NAMES):
            raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; known keys: {sorted(_ENV_NAMES)}")
        values.update({k: _coerce(k, v, str(path)) for k, v in data.items()})
    for name, var in _ENV_NAMES.items():
        if var in env:
            values[name] = _coerce(name, env[var], f"environment variable {var}")
    return replace(PrimusPipeConfig(), **values)
