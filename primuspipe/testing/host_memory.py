"""CPU runs that keep freed memory in the process, as a GPU's caching allocator keeps device memory.

Why: on CPU, torch allocates tensors with the C library's ``malloc``. glibc's defaults hand freed memory
back to the kernel -- blocks above its (self-raising) mmap threshold are unmapped when freed, and the
heap's free top is trimmed -- so a node that later needs more memory than the process still holds takes
it back page by page, each first touch a minor page fault whose kernel time counts as the node's CPU.
Which nodes pay depends on each schedule's memory pattern, not on the node: measured on the CPU prediction
bench (tiny GPT, hidden 128, pp 2, m 8, per-node ``RUSAGE_THREAD`` minor faults), 1F1B's steady nodes
took 0, the split probe's window nodes (a deferred W's inputs held) 300-3,800 per node and ZB-H1's last
rank's B 80-380, while plain 1F1B's and ZB-H1's first rank's took none; their CPU times were 5-9 %
(window) and 4-6 % (ZB-H1's last rank's F and B) above the same kinds' elsewhere. With freed memory kept
(:data:`KEEP_FREED_ENV`), every node took under 50 faults and those excesses fell to 0-3 %. A GPU run
has no such cost: its caching allocator keeps the blocks it freed for the next node. The prediction
benches run their ranks this way with ``--keep-freed-memory`` (``bench/bench_prediction.py``,
``bench/bench_auto_replan.py``); it made the probe's window share 0-2 % but the predictions no better
overall (docs/simulator.md), so it is an option there, not the default.

glibc only: elsewhere :func:`keep_freed_memory` changes nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (``<malloc.h>``)."""

MMAP_THRESHOLD = 32 * 1024 * 1024
"""The largest mmap threshold glibc accepts on 64-bit hosts: blocks below it come from the heap, whose
freed memory stays mapped (larger ones are still unmapped when freed)."""
TRIM_THRESHOLD = 2**31 - 1
"""The heap's free top is handed back only beyond this (the largest value ``mallopt`` takes): never, for
the runs here."""

KEEP_FREED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
"""The same settings as environment variables, for processes started afterwards (glibc reads them when a
process starts; torchrun's workers inherit them)."""


def keep_freed_memory() -> bool:
    """Make this process (and the processes it forks afterwards) keep freed memory: ``mallopt`` with
    :data:`MMAP_THRESHOLD` and :data:`TRIM_THRESHOLD`, which also stops glibc from moving the thresholds
    by itself. Returns whether the C library took both (False where it is not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
