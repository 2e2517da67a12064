"""Other frameworks' names for our algorithms, so their configs run unchanged.

An alias is a name, the registered algorithm it runs, the options it fixes and, where the framework
pins it, the vpp. ``get_algorithm`` resolves aliases (``primuspipe list`` prints them with what
differs); a table built through an alias carries the target's name, since that is what ran. The
mapping and every difference is explained in docs/primus.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Alias:
    name: str
    target: str
    """The registered algorithm the name runs."""
    origin: str
    """The framework that uses the name."""
    note: str
    """How our algorithm differs from the framework's, in one sentence."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Options of ``target`` the alias fixes (not settable through the alias)."""
    placement: str | None = None
    """The placement the alias pins, for a target that chooses its own (``zb-auto``)."""
    vpp: int | None = None
    """The vpp the alias requires, where the framework asserts one and the target takes any."""


PRIMUS = "Primus"

ALIASES: tuple[Alias, ...] = (
    Alias("1f1b-interleaved", "interleaved-1f1b", PRIMUS,
          "the same order (chunks take turns in groups of pp microbatches); ours also runs microbatch counts "
          "that are not a multiple of pp"),
    Alias("zero-bubble", "zb-h1", PRIMUS,
          "both hold 1F1B's activations with B and W split; ours places each W by a list scheduler under the cost "
          "model, Primus's after the B of the next steady-state step, so the W positions can differ"),
    Alias("zero-bubble-heuristic", "zb-auto", PRIMUS,
          "Primus keeps the best of 8 greedy orders under pp_cost_f/b/w and pp_max_mem; ours searches the fixed "
          "algorithms, greedy fills and an order MILP under the same costs and limit (never slower in the simulator)",
          options=MappingProxyType({"placement": "interleaved"}), placement="interleaved", vpp=1),
    Alias("zbv-formatted", "zbv", PRIMUS,
          "the same ZBV warm-up / steady / cool-down pattern at 1F1B's memory; Primus pads to at least 2*pp-1 "
          "microbatches, ours schedules exactly the microbatches given"),
    Alias("zbv-greedy", "v-half", PRIMUS,
          "Primus's greedy V class needs a memory mode (its v-half and v-min); without one we take half"),
    Alias("zbv-greedy-half", "v-half", PRIMUS, "Primus's projection name for v-half"),
    Alias("zbv-greedy-min", "v-min", PRIMUS, "Primus's projection name for v-min"),
)
"""Primus's ``pp_algorithm`` names that are not ours already (``1f1b``, ``v-half`` and ``v-min`` are the
same names with the same schedules)."""

BY_NAME: Mapping[str, Alias] = MappingProxyType({a.name: a for a in ALIASES})
