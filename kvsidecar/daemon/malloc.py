"""glibc malloc settings that keep the daemon's RSS near what it holds.

A render of a large exposition allocates a few MB of strings on whichever thread scrapes;
glibc gives each thread its own arena and, after the first large free, raises its mmap
threshold, so later bodies land in arenas that keep their peak. The same conforming
target measured 60-110 MB peak RSS from run to run; with two arenas and a fixed
threshold, 58-62 MB (`kvsidecar bench worsttarget`, docs/reliability.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 128 * 1024  # glibc's initial value; setting it stops the dynamic raise
ARENA_MAX = 2


def bound_malloc() -> bool:
    """Apply the settings (call before threads start); False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return False  # musl, or no libc found: nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_ARENA_MAX, ARENA_MAX) == 1
    ok &= mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD) == 1
    return ok


_trim: Callable[[int], int] | None = None


def release_free_memory() -> bool:
    """Give the kernel back the whole free pages inside every arena (glibc's
    ``malloc_trim(0)``), not only the top of the heap that ``free`` trims by itself: memory
    freed by one thread in the middle of an arena stays resident until another allocation
    there reuses it, which after a burst of connections may be never (a burst of 900
    handshakes left 8.7-9.7 MiB resident, docs/kv-events.md "Limits"). A walk of the free
    chunks: milliseconds. False where malloc is not glibc's."""
    global _trim
    if _trim is None:
        try:
            trim = ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
        except (OSError, AttributeError):
            return False
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        _trim = trim
    _trim(0)
    return True
