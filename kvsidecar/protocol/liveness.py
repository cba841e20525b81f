"""Writer liveness: an OFD write lock, which a read-only reader cannot take.

The writer holds ``F_OFD_SETLK`` with ``F_WRLCK`` on its segment for its whole life.
A write lock needs a descriptor open for writing, and segments are 0640, so only the
engine's own uid can ever hold one: a reader (or anyone in the group) can at most take
a *read* lock, which `write_locked` ignores. (``flock`` has no such rule: a reader's
``LOCK_EX`` on a read-only descriptor made a dead writer look alive forever and kept a
restarted engine out; segments of layout v1.0 still use it, see `flock_held`.)

OFD locks belong to the open file description, like ``flock``: they work across PID
namespaces, are released when the last descriptor closes (a crash included), and a
forked child that closes its copy does not release the parent's lock.
"""

from __future__ import annotations

import fcntl
import os
import struct

# struct flock {short l_type; short l_whence; off_t l_start; off_t l_len; pid_t l_pid;}
# on LP64 Linux (x86-64, aarch64): 32 bytes with padding. l_pid must be 0 for OFD locks.
_FLOCK = struct.Struct("hhqqi4x")
_WHOLE_FILE_WRITE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)


def lock_for_life(fd: int, *, wait: bool = False) -> None:
    """Take the write lock on the whole file. BlockingIOError if someone holds a lock on it
    (``wait=False``); EBADF (OSError) if fd is not open for writing."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, _WHOLE_FILE_WRITE)


def write_locked(fd: int) -> bool:
    """True if any open file description holds a *write* lock on the file (a live writer).

    Works on a read-only descriptor. A read lock (all a reader can take) reads as False.
    """
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _WHOLE_FILE_WRITE)
    return _FLOCK.unpack(got)[0] == fcntl.F_WRLCK


def flock_held(fd: int) -> bool:
    """Layout v1.0 liveness: True if someone holds ``flock(LOCK_EX)`` (the writer, or anyone
    who could open the file: that is why v1.1 moved to `write_locked`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
