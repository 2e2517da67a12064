"""The projection's only door into the rest of primuspipe: schedules, the simulator, algorithms, errors.

Every other projection module imports what it needs from here, so when those packages move, one
file's import lines change. Nothing here adds behaviour; it re-exports.
"""

from primuspipe.algorithms import get_algorithm, list_algorithms
from primuspipe.costs import ComputeCosts
from primuspipe.errors import ConfigError, PrimusPipeError
from primuspipe.placement import Placement
from primuspipe.schedule import build_schedule
from primuspipe.simulator import CostModel, Link, MemoryCost, P2PCost, simulate

__all__ = ["ComputeCosts", "ConfigError", "CostModel", "Link", "MemoryCost", "P2PCost", "Placement", "PrimusPipeError",
           "build_schedule", "get_algorithm", "list_algorithms", "simulate"]
