"""The segment writer, used by the agent inside the engine process.

Creation is careful and may fail with a clear `SegmentError`; publishing is
one msgspec ``encode_into`` a preallocated buffer plus one C call (no system
call, no lock, no allocation beyond the encoder's).

Creation, in order (so no reader ever sees a half-made segment):

1. open ``.<name>.<pid>.<rand>.tmp`` with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode
   0640 (``fchmod`` after, so the umask cannot widen or narrow it), optional
   group;
2. ``ftruncate`` + ``posix_fallocate``: tmpfs pages are allocated now, so a full
   /dev/shm is an error here and never a SIGBUS in the engine later;
3. write the directory, then the header, then the magic last;
4. take ``flock(LOCK_EX)`` for the writer's life (liveness across PID
   namespaces: a reader's ``LOCK_SH|LOCK_NB`` probe fails while we live);
5. ``rename`` onto the final name, replacing a dead predecessor atomically.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import mmap
import os
import secrets
import stat
import time
import weakref

import msgspec

from kvsidecar.protocol import _seqlock, layout
from kvsidecar.protocol.names import DEFAULT_SHM_DIR, segment_path, validate_name
from kvsidecar.protocol.schema import Capabilities, Snapshot, current_capabilities

DEFAULT_MODE = 0o640


class SegmentError(Exception):
    """Creating or using a segment failed; the message is one line with the fix."""


class ShmFullError(SegmentError):
    """The shm filesystem has no room for the segment."""


class SegmentBusyError(SegmentError):
    """A live writer already owns this segment name."""


class SegmentWriter:
    """Owns one segment for the life of an agent. Not thread-safe: one engine thread publishes."""

    def __init__(
        self,
        name: str,
        *,
        shm_dir: str = DEFAULT_SHM_DIR,
        mode: int = DEFAULT_MODE,
        group: str | int | None = None,
        slot_capacity: int = layout.DEFAULT_SLOT_CAPACITY,
        capabilities: Capabilities | None = None,
    ) -> None:
        self.name = validate_name(name)
        self.shm_dir = shm_dir
        self.path = segment_path(name, shm_dir)
        self.mode = mode
        self.incarnation = secrets.randbits(63) | 1  # non-zero
        self.generation = 1
        self._pid = os.getpid()
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        self._buf = bytearray(slot_capacity)
        self._publish = _seqlock.publish
        caps = capabilities or current_capabilities()
        directory = msgspec.msgpack.encode(caps)
        slot_off, slot_stride, total = layout.plan(len(directory), slot_capacity)
        self.total_size = total
        self.slot_capacity = slot_capacity
        self._create(directory, slot_off, slot_stride, slot_capacity, total, group)
        # A truncation of our file by another process becomes an OSError, not a SIGBUS.
        _seqlock.install_sigbus_guard()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    # -- creation ---------------------------------------------------------------

    def _create(
        self,
        directory: bytes,
        slot_off: int,
        slot_stride: int,
        slot_capacity: int,
        total: int,
        group: str | int | None,
    ) -> None:
        if not os.path.isdir(self.shm_dir):
            raise SegmentError(
                f"shm directory {self.shm_dir} does not exist: create it or set "
                "KVSIDECAR_SHM_DIR to a tmpfs directory"
            )
        self.generation = self._predecessor_generation() + 1
        tmp = os.path.join(self.shm_dir, f".{self.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, self.mode)
        except OSError as e:
            raise SegmentError(f"cannot create segment in {self.shm_dir}: {e.strerror}") from e
        try:
            os.fchmod(fd, self.mode)
            if group is not None:
                gid = group if isinstance(group, int) else grp.getgrnam(group).gr_gid
                os.fchown(fd, -1, gid)
            os.ftruncate(fd, total)
            _preallocate(fd, total, self.shm_dir)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            dir_off = layout.HEADER_LEN
            mm[dir_off : dir_off + len(directory)] = directory
            header = layout.pack_header(
                magic=b"\0" * 8,
                state=layout.STATE_READY,
                total_size=total,
                incarnation=self.incarnation,
                generation=self.generation,
                writer_pid=os.getpid() & 0xFFFFFFFF,
                writer_uid=os.getuid() & 0xFFFFFFFF,
                start_wall_ns=time.time_ns(),
                dir_off=dir_off,
                dir_len=len(directory),
                slot_off=slot_off,
                slot_stride=slot_stride,
                slot_capacity=slot_capacity,
                dir_crc=_seqlock.crc32(directory),
            )
            mm[0 : layout.HEADER_LEN] = header
            _seqlock.heartbeat(mm)
            _seqlock.fence_release()  # everything above before the magic
            mm[0:8] = layout.MAGIC
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._fd = fd
        self._mm = mm

    def _predecessor_generation(self) -> int:
        """Generation of a dead segment we are about to replace; refuse a live one."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SegmentError(
                    f"{self.path} is a symlink: refusing to replace it; remove it first"
                ) from e
            return 0
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SegmentError(f"{self.path} exists and is not a regular file: remove it first")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SegmentBusyError(
                    f"segment {self.name} is owned by a live writer: give this rank a "
                    "distinct name (engine/rank) or stop the other process"
                ) from None
            raw = os.pread(fd, layout.HEADER_LEN, 0)
            if len(raw) == layout.HEADER_LEN and raw[:8] == layout.MAGIC:
                return layout.Header(raw).generation
            return 0
        finally:
            os.close(fd)

    # -- hot path ---------------------------------------------------------------

    def publish(self, snapshot: Snapshot) -> int:
        """Encode and publish one snapshot; returns its sequence number (0 if closed)."""
        mm = self._mm
        if mm is None:
            return 0
        self._encoder.encode_into(snapshot, self._buf)
        return self._publish(mm, self._buf)

    def publish_bytes(self, payload: bytes | bytearray | memoryview) -> int:
        mm = self._mm
        if mm is None:
            return 0
        return self._publish(mm, payload)

    def heartbeat(self) -> None:
        """Refresh the heartbeat without a new snapshot (an idle engine is not a hung one)."""
        if self._mm is not None:
            _seqlock.heartbeat(self._mm)

    # -- teardown ---------------------------------------------------------------

    def close(self, unlink: bool = True) -> None:
        """Mark CLOSED, unlink (if the name is still ours) and release the lock."""
        if self._closed:
            return
        self._closed = True
        mm, fd = self._mm, self._fd
        self._mm, self._fd = None, -1
        if mm is None:
            return
        try:
            if os.fstat(fd).st_size >= layout.HEADER_LEN:  # never touch truncated pages
                mm[layout.OFF_STATE] = layout.STATE_CLOSED
        except OSError:
            pass
        if unlink and os.getpid() == self._pid:
            try:
                if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    os.unlink(self.path)
            except OSError:
                pass
        mm.close()
        os.close(fd)

    def _forget_in_child(self) -> None:
        # A forked child shares our open file description: keeping it open would
        # keep the flock (and so "alive") after the engine itself died.
        self._closed = True
        if self._mm is not None:
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
        self._mm, self._fd = None, -1

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _after_fork(ref: weakref.ref[SegmentWriter]) -> None:
    writer = ref()
    if writer is not None:
        writer._forget_in_child()


def _preallocate(fd: int, size: int, shm_dir: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ShmFullError(
                f"{shm_dir} is full: the segment needs {size} bytes; free space there or "
                f"enlarge it (mount -o remount,size=... {shm_dir}, or a bigger emptyDir sizeLimit)"
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise SegmentError(f"cannot preallocate segment in {shm_dir}: {e.strerror}") from e
        # No fallocate on this filesystem: touch every page, as HotSpot does.
        for off in range(0, size, layout.PAGE):
            os.pwrite(fd, b"\0", off)
