"""The projection's only door into the rest of primuspipe: schedules, the simulator, algorithms, errors.

Every other projection module imports what it needs from here, so when those packages move, one
file's import lines change. Nothing here adds behaviour; it re-exports.
"""

from primuspipe.algorithms import get_algorithm, list_algorithms
from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, PrimusPipeError
from primuspipe import strict
from primuspipe.ir.cost_model import CostModel, LateWork, Link, MemoryCost, P2PCost, negligible
from primuspipe.ir.costs import ComputeCosts
from primuspipe.io.timeline import idle_share
from primuspipe.ir.placement import Placement
from primuspipe.simulator import simulate

__all__ = ["ComputeCosts", "ConfigError", "CostModel", "LateWork", "Link", "MemoryCost", "P2PCost", "Placement",
           "PrimusPipeError", "build_schedule", "get_algorithm", "idle_share", "list_algorithms", "negligible",
           "simulate", "strict"]
