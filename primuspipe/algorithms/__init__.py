"""Schedule algorithms: pure functions from a shape to a compute-only table (no torch here).

The built-in algorithms register themselves when their modules are imported; the registry imports
them (and the ``zb-auto`` search, which lives a layer up in :mod:`primuspipe.search`) on first look-up,
exactly as it loads third-party plug-ins, so this package never imports the layers above it.
"""

from primuspipe.algorithms.registry import (
    AlgorithmInfo,
    ScheduleRequest,
    get_algorithm,
    list_algorithms,
    list_aliases,
    register,
)

__all__ = ["AlgorithmInfo", "ScheduleRequest", "get_algorithm", "list_algorithms", "list_aliases", "register"]
