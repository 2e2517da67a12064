"""The last check before a command prints a result: no output of primuspipe holds an impossible figure.

Inputs are checked one by one at the edges (:mod:`primuspipe.strict`), but finite inputs can still
combine into an impossible result -- a compute time of 1e308 summed over a step is infinity, and a
bubble rate computed from it NaN; a cost file measured on another model can make a projection claim
more than the hardware's peak. Such a figure is refused here, naming the figure and the likely cause,
instead of being printed: every number finite, every bubble rate in [0, 1], every MFU in [0, 1]. JSON
is written with ``allow_nan=False`` so ``Infinity``/``NaN`` (not JSON) can never appear.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from primuspipe.errors import PrimusPipeError

_TOLERANCE = 1e-9


class ImpossibleResultError(PrimusPipeError):
    """A result that cannot be true (infinite, NaN, a share outside [0, 1]) came out of valid-looking inputs."""


def check(data: Any, where: str, cause: str = "the inputs' numbers are too large to compute with") -> Any:
    """Refuse ``data`` (numbers, mappings and lists of them) if any figure in it is impossible; returns it."""
    for path, value in _numbers(data, ""):
        name = path.rsplit(".", 1)[-1].lower()
        if not math.isfinite(value):
            what = "undefined" if math.isnan(value) else "too large for a number"
            raise ImpossibleResultError(f"{where}: {path.lstrip('.')} came out {what}; {cause}")
        if ("bubble" in name or "mfu" in name) and not -_TOLERANCE <= value <= 1 + _TOLERANCE:
            raise ImpossibleResultError(f"{where}: {path.lstrip('.')} is {value:.4g}, outside [0, 1]; {cause}")
    return data


def json_text(data: Any, where: str = "the result") -> str:
    """``data`` as indented JSON, after :func:`check`-ing that every figure in it is possible."""
    return json.dumps(check(data, where), indent=1, allow_nan=False)


def _numbers(data: Any, path: str):
    if isinstance(data, bool) or data is None:
        return
    if isinstance(data, (int, float)):
        yield path, float(data) if not isinstance(data, int) or abs(data) < 2**1023 else math.inf
    elif isinstance(data, Mapping):
        for key, value in data.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            yield from _numbers(value, f"{path}[{i}]")
