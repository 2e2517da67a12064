"""``primuspipe.testing.host_memory``: a CPU process that keeps freed memory takes no page faults to
reuse it, where glibc's defaults make it fault the pages back in (the cost that made a node's CPU time
depend on the schedule's memory pattern)."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

from primuspipe.testing.host_memory import KEEP_FREED_ENV

# a fresh process: allocate, touch and free ``size`` bytes ``rounds`` times (sizes from small to the
# largest block the settings keep), print the minor page faults of each round but the first
REUSE = """
import ctypes, ctypes.util, resource, sys
keep = sys.argv[1]
if keep == "call":
    from primuspipe.testing.host_memory import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = int(sys.argv[2])
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)
print(max(faults[1:]))
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or not ctypes.util.find_library("c"),
                           reason="the settings are glibc's")


def reuse_faults(how: str, size: int) -> int:
    env = {"PATH": "/usr/bin:/bin", **({} if how != "env" else KEEP_FREED_ENV)}
    done = subprocess.run([sys.executable, "-c", REUSE, how, str(size)], capture_output=True, text=True, check=True,
                          env={**env, "PYTHONPATH": ":".join(sys.path)})
    return int(done.stdout)


@glibc
@pytest.mark.parametrize("size_mb", [1, 4, 24])
def test_glibc_defaults_fault_freed_memory_back_in(size_mb):
    """The mechanism, on this host: a block freed and allocated again costs page faults (at least half its
    pages once more), so a test below that finds none is the settings' doing."""
    size = size_mb << 20
    assert reuse_faults("default", size) >= size // 4096 // 2


@glibc
@pytest.mark.parametrize("how", ["call", "env"])
@pytest.mark.parametrize("size_mb", [1, 4, 24])
def test_kept_memory_is_reused_without_page_faults(how, size_mb):
    """``keep_freed_memory()`` in the process, or ``KEEP_FREED_ENV`` given to a new one: the block's pages
    stay mapped, so allocating it again touches no new page (a few faults of the interpreter's own)."""
    assert reuse_faults(how, size_mb << 20) < 64
