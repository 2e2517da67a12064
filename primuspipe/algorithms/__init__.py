"""Schedule algorithms: pure functions from a shape to a compute-only table (no torch here)."""

from primuspipe.algorithms import classic, dualpipe_v, vshape, zb_auto, zero_bubble  # noqa: F401  (registers the built-in algorithms)
from primuspipe.algorithms.registry import (
    AlgorithmInfo,
    ScheduleRequest,
    get_algorithm,
    list_algorithms,
    register,
)

__all__ = ["AlgorithmInfo", "ScheduleRequest", "get_algorithm", "list_algorithms", "register"]
