"""glibc malloc settings that keep the daemon's RSS near what it holds.

A render of a large exposition allocates a few MB of strings on whichever thread scrapes;
glibc gives each thread its own arena and, after the first large free, raises its mmap
threshold, so later bodies land in arenas that keep their peak. The same conforming
target measured 60-110 MB peak RSS from run to run; with two arenas and a fixed
threshold, 58-62 MB (`kvsidecar bench worsttarget`, docs/reliability.md). Free pages in
the middle of an arena are given back on request (`release_free_memory`: after a burst of
connections, streams/zmq_admission.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 128 * 1024  # glibc's initial value; setting it stops the dynamic raise
ARENA_MAX = 2


@functools.cache
def _glibc(name: str) -> Any:
    """The C library's function `name`, or None (musl, or no libc found)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or None), name)
    except (OSError, AttributeError):
        return None


def bound_malloc() -> bool:
    """Apply the settings (call before threads start); False where malloc is not glibc's."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False  # nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_ARENA_MAX, ARENA_MAX) == 1
    ok &= mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD) == 1
    return ok


def release_free_memory() -> bool:
    """Give the kernel back the whole free pages inside every arena (glibc's
    ``malloc_trim(0)``), not only the top of the heap that ``free`` trims by itself: memory
    freed by one thread in the middle of an arena stays resident until another allocation
    there reuses it, which after a burst of connections may be never (a burst of 900
    handshakes left 8.7-9.7 MiB resident, docs/kv-events.md "Limits"). A walk of the free
    chunks: milliseconds. False where malloc is not glibc's."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
