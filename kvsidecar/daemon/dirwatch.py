"""What changed in the segment directory since the last look, from inotify (Linux).

A neighbour's flood of files (200,000 in /dev/shm) makes every listing of the directory
cost a good part of a second; with a file created and deleted every few ms the listing
was redone as often as pacing allowed (scan.py). The kernel can say which names changed
instead: a scan then looks at those names only (an ``lstat`` each), and lists the
directory again only when the kernel cannot say (its queue overflowed, the directory
itself changed, too many names at once) or inotify is not available.

What is watched: a name created, deleted or renamed in or out (a new engine, a gone
one, a replaced file), and a file's attributes or contents changed in place (chown,
chmod, write, truncate: a refused file is judged again). Nothing is kept per name
between two looks; the names of one look are capped (`max_names`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import weakref
from collections.abc import Callable

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

WATCHED = (
    IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
    | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
)  # fmt: skip
# The directory itself changed (chmod, deleted, moved, unmounted) or events were lost:
# only a listing can say what is there now.
_RELIST = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_Q_OVERFLOW | IN_IGNORED
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then name
_READ_SIZE = 64 * 1024

_libc: ctypes.CDLL | None = None


def _inotify() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.inotify_init1.argtypes = [ctypes.c_int]
            libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


class DirWatch:
    """An inotify watch on one directory (identified by its st_dev/st_ino when the watch
    was set), or a record of why there is none."""

    def __init__(self, path: str, dev_ino: tuple[int, int]) -> None:
        """Start watching `path`, whose os.stat() gave `dev_ino` just before (a directory
        replaced in between shows as another identity at the next look: watched again)."""
        self.dev_ino = dev_ino
        self.fd = -1
        libc = _inotify()
        if libc is None:
            return
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            return  # EMFILE (max_user_instances), ENOSYS: list the directory instead
        if libc.inotify_add_watch(fd, os.fsencode(path), WATCHED | IN_ONLYDIR) < 0:
            os.close(fd)
            return
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    @property
    def active(self) -> bool:
        return self.fd >= 0

    def close(self) -> None:
        if self.fd >= 0:
            self._closer()
            self.fd = -1

    def changes(self, max_names: int, wanted: Callable[[str], bool]) -> set[str] | None:
        """The names (those `wanted`) changed since the last call, or None if a listing
        is needed: no watch, lost events, the directory itself changed, or more than
        `max_names` names (a listing costs the same then, and is paced)."""
        if self.fd < 0:
            return None
        names: set[str] = set()
        relist = False
        while True:
            try:
                buf = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                self.close()
                return None
            off = 0
            while off + _EVENT.size <= len(buf):
                _, mask, _, size = _EVENT.unpack_from(buf, off)
                start = off + _EVENT.size
                off = start + size
                if mask & _RELIST or not size:
                    relist = True  # keep draining: the queue is read empty either way
                    continue
                if relist:
                    continue
                name = os.fsdecode(buf[start:off].rstrip(b"\0"))
                if wanted(name):
                    names.add(name)
                    if len(names) > max_names:
                        relist = True
            if mask & IN_IGNORED:  # the watch is gone (the directory was removed)
                self.close()
                return None
        return None if relist else names
