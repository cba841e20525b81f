"""The segment writer, used by the agent inside the engine process.

Creation is careful and may fail with a clear `SegmentError`; publishing is
one msgspec ``encode_into`` a preallocated buffer plus one C call (no system
call, no lock, no allocation beyond the encoder's).

Creation, in order (so no reader ever sees a half-made segment, and of two writers
starting under one name exactly one wins):

1. open the shm directory without following a symlink; the default one
   (`names.DEFAULT_SHM_DIR`) is created 0750 and refused if another user owns it;
2. open ``.<name>.<pid>.<rand>.tmp`` with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode
   0640 (``fchmod`` after, so the umask cannot widen or narrow it), optional
   group;
3. ``ftruncate`` + ``posix_fallocate``: tmpfs pages are allocated now, so a full
   /dev/shm is an error here and never a SIGBUS in the engine later;
4. write the directory, then the header, then the magic last;
5. take the liveness locks for the writer's life: an OFD write lock (layout
   v1.1; a read-only reader cannot take one) and ``flock(LOCK_EX)`` for v1.0
   readers;
6. under the name's install lock (``.<name>.lock``, 0600, held for microseconds):
   refuse a name owned by another user (squatting), a symlink, or a live writer;
   else ``rename`` onto the name, replacing a dead predecessor atomically. Two
   writers racing are serialized by that lock, so the second finds the first
   alive and gets `SegmentBusyError`.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import mmap
import operator
import os
import pwd
import secrets
import stat
import struct
import time
import weakref
from collections.abc import Callable, Collection

import msgspec

from kvsidecar.protocol import _seqlock, layout, liveness
from kvsidecar.protocol.names import (
    DEFAULT_SHM_DIR,
    DEFAULT_SHM_DIR_MODE,
    segment_path,
    validate_name,
)
from kvsidecar.protocol.schema import (
    MAX_DIRECTORY_BYTES,
    Capabilities,
    Snapshot,
    current_capabilities,
    field_order_error,
)
from kvsidecar.settings import GROUP, SHM_DIR

DEFAULT_MODE = 0o640


class SegmentError(Exception):
    """Creating or using a segment failed; the message is one line with the fix."""


class ShmFullError(SegmentError):
    """The shm filesystem has no room for the segment."""


class SegmentBusyError(SegmentError):
    """A live writer already owns this segment name (or is starting under it right now)."""


class SegmentSquattedError(SegmentError):
    """The name (or the default directory) belongs to another user: refused, not replaced."""


# The install lock is held for microseconds by a starting or closing writer of our own
# uid; wait this long for it, never forever (the engine must start).
_INSTALL_LOCK_WAIT_S = 2.0
_GENERATION = struct.Struct("<Q")
# The files a supervisor may close for its dead children (close_for_writers): snapshot
# segments and KV-event segments (kv_events_layout.MAGIC; not imported: it imports us).
_MAGICS = (layout.MAGIC, b"KVSCEVT1")


def _enc_hook(obj: object) -> object:
    # numpy / torch scalars in a record: msgspec calls this only for types it does not
    # know, so the usual path pays nothing. .item() gives the matching Python scalar.
    item = getattr(obj, "item", None)
    if item is not None:
        value = item()
        if isinstance(value, (int, float, bool)):
            return value
    try:
        return operator.index(obj)
    except TypeError:
        raise NotImplementedError(f"cannot encode {type(obj).__name__}") from None


class SegmentFile:
    """One file in the shm directory, owned by one writer for its life: the careful
    creation (module doc, steps 1-6), liveness locks, install under the name's lock,
    clean close and fork safety. Shared by the snapshot segment (`SegmentWriter`) and
    the KV-event segment (`kv_events_writer.KVEventsWriter`): both files start with the
    same 56 bytes (magic, versions, state, size, incarnation, generation, pid, uid, start
    time; segment-format.md). Subclasses set MAGIC and build their bytes in ``fill``."""

    MAGIC = layout.MAGIC

    def __init__(self, name: str, *, shm_dir: str, mode: int) -> None:
        self.name = validate_name(name)
        self.shm_dir = shm_dir
        self.path = segment_path(name, shm_dir)
        self.mode = mode
        self.incarnation = secrets.randbits(63) | 1  # non-zero
        self.generation = 1
        self._pid = os.getpid()
        self._fd = -1
        self._dir_fd = -1
        self._mm: mmap.mmap | None = None
        self._closed = False
        self._faulted = False

    def _after_create(self) -> None:
        # A truncation of our file by another process becomes an OSError, not a SIGBUS.
        _seqlock.install_sigbus_guard()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    def _extra_locks(self, fd: int) -> None:
        """Locks beyond the OFD write lock (the snapshot segment's flock for v1.0 readers)."""

    def _legacy_live(self, raw: bytes, fd: int) -> bool:
        """Whether a predecessor of our kind (raw: its header) lives by an older rule."""
        return False

    # -- creation ---------------------------------------------------------------

    def _create(
        self, total: int, group: str | int | None, fill: Callable[[mmap.mmap], None]
    ) -> None:
        """Steps 1-6 of the module doc; ``fill(mm)`` writes every byte but the magic."""
        gid = None
        if group is not None:
            try:
                gid = _gid(group)
            except KeyError:
                raise SegmentError(f"group {group!r} does not exist: fix {GROUP.name}") from None
        self._dir_fd = dir_fd = _open_dir(self.shm_dir, gid)
        tmp = f".{self.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, self.mode, dir_fd=dir_fd)
        except OSError as e:
            raise SegmentError(f"cannot create segment in {self.shm_dir}: {e.strerror}") from e
        try:
            os.fchmod(fd, self.mode)
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.ftruncate(fd, total)
            _preallocate(fd, total, self.shm_dir)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fill(mm)
            _seqlock.fence_release()  # everything above before the magic
            mm[0:8] = self.MAGIC
            liveness.lock_for_life(fd)  # our own new inode: nobody else can hold a lock yet
            self._extra_locks(fd)
            self._install(tmp, fd, mm)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        self._fd = fd
        self._mm = mm

    def _install(self, tmp: str, fd: int, mm: mmap.mmap) -> None:
        """Rename tmp onto the name unless another user, a symlink or a live writer has it."""
        lock = self._install_lock()
        try:
            self.generation = self._predecessor_generation() + 1
            _GENERATION.pack_into(mm, layout.OFF_GENERATION, self.generation)
            _seqlock.fence_release()
            os.rename(tmp, self.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        finally:
            self._install_unlock(lock)

    def _install_lock(self) -> int:
        return _install_lock(self._dir_fd, self.shm_dir, self.name)

    def _install_unlock(self, lfd: int) -> None:
        _install_unlock(self._dir_fd, self.name, lfd)

    def _predecessor_generation(self) -> int:
        """Generation of a dead segment we are about to replace; refuse anything else."""
        try:
            st = os.stat(self.name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if stat.S_ISLNK(st.st_mode):
            raise SegmentError(f"{self.path} is a symlink: refusing to replace it; remove it first")
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError(f"{self.path} exists and is not a regular file: remove it first")
        if st.st_uid != os.geteuid():
            raise _squatted(self.path, st.st_uid)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.name, flags, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return 0
        except OSError as e:
            raise SegmentError(f"cannot open {self.path} to check it: {e.strerror}") from e
        try:
            raw = os.pread(fd, layout.HEADER_LEN, 0)
            ours = len(raw) == layout.HEADER_LEN and raw[:8] == self.MAGIC
            # A read lock (all a reader can take) is not a writer.
            live = liveness.write_locked(fd) or (ours and self._legacy_live(raw, fd))
            if live:
                raise SegmentBusyError(
                    f"segment {self.name} is owned by a live writer: give this rank a "
                    "distinct name (engine/rank) or stop the other process"
                )
            return _GENERATION.unpack_from(raw, layout.OFF_GENERATION)[0] if ours else 0
        finally:
            os.close(fd)

    # -- teardown ---------------------------------------------------------------

    def mark_faulted(self) -> None:
        """Say the engine hit a fatal error: readers read the segment dead from now on
        (``error_kind`` ``faulted``), and `close()` keeps it so (no CLOSED, no unlink): a
        fault must never read as a clean stop, whoever stops the engine afterwards. A
        segment already CLOSED (by a supervisor stopping the engine) stays CLOSED. Never
        raises."""
        mm = self._mm
        if mm is None:
            return
        try:
            if os.fstat(self._fd).st_size < layout.HEADER_LEN:  # never touch truncated pages
                return
            if mm[layout.OFF_STATE] == layout.STATE_CLOSED:
                return  # a supervisor closed it for a routine stop (close_for_writers)
            mm[layout.OFF_STATE] = layout.STATE_FAULTED
            self._faulted = True
        except (OSError, ValueError):
            pass

    @property
    def faulted(self) -> bool:
        return self._faulted

    def close(self, unlink: bool = True) -> None:
        """Mark CLOSED, unlink (if the name is still ours) and release the lock; a faulted
        segment is only released (it stays FAULTED and in place: readers read it dead)."""
        if self._closed:
            return
        self._closed = True
        mm, fd = self._mm, self._fd
        self._mm, self._fd = None, -1
        if mm is None:
            self._close_dir()
            return
        if self._faulted:
            unlink = False
        else:
            try:
                if os.fstat(fd).st_size >= layout.HEADER_LEN:  # never touch truncated pages
                    mm[layout.OFF_STATE] = layout.STATE_CLOSED
            except OSError:
                pass
        if unlink and os.getpid() == self._pid:
            try:
                lock = self._install_lock()  # so a starting successor never loses its file
            except (OSError, SegmentError):
                lock = -1
            try:
                own = os.fstat(fd).st_ino
                st = os.stat(self.name, dir_fd=self._dir_fd, follow_symlinks=False)
                if st.st_ino == own:
                    os.unlink(self.name, dir_fd=self._dir_fd)
            except OSError:
                pass
            if lock >= 0:
                self._install_unlock(lock)
        mm.close()
        os.close(fd)
        self._close_dir()

    def _close_dir(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def _forget_in_child(self) -> None:
        # A forked child shares our open file description: keeping it open would
        # keep the flock (and so "alive") after the engine itself died.
        self._closed = True
        if self._mm is not None:
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
        self._mm, self._fd = None, -1
        self._close_dir()

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class SegmentWriter(SegmentFile):
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
        super().__init__(name, shm_dir=shm_dir, mode=mode)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        caps = capabilities or current_capabilities()
        directory = msgspec.msgpack.encode(caps)
        slot_off, slot_stride, total = layout.plan(len(directory), slot_capacity)
        # Never create what every reader refuses (segment-format.md sections 1 and 4).
        if total > layout.MAX_SEGMENT_SIZE:
            raise SegmentError(
                f"slot_capacity {slot_capacity} makes a {total}-byte segment > "
                f"{layout.MAX_SEGMENT_SIZE} (the largest a reader accepts): use a smaller slot"
            )
        wrong = field_order_error(caps)
        if wrong is not None:
            raise SegmentError(
                f"capabilities: {wrong}: names must keep this major's order, each once"
            )
        if len(directory) > MAX_DIRECTORY_BYTES:
            raise SegmentError(
                f"directory of {len(directory)} bytes > {MAX_DIRECTORY_BYTES}: "
                "fewer or shorter field names"
            )
        self._buf = bytearray(slot_capacity)
        self._publish = _seqlock.publish
        self.total_size = total
        self.slot_capacity = slot_capacity

        def fill(mm: mmap.mmap) -> None:
            dir_off = layout.HEADER_LEN
            mm[dir_off : dir_off + len(directory)] = directory
            mm[0 : layout.HEADER_LEN] = layout.pack_header(
                magic=b"\0" * 8,
                state=layout.STATE_READY,
                total_size=total,
                incarnation=self.incarnation,
                generation=self.generation,  # final value set under the install lock
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
            _seqlock.heartbeat(mm)

        self._create(total, group, fill)
        self._after_create()

    def _extra_locks(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # for layout v1.0 readers

    def _legacy_live(self, raw: bytes, fd: int) -> bool:
        # flock only for a v1.0 writer, which has no OFD lock (and whose flock a reader
        # could also hold).
        return layout.Header(raw).minor < layout.MINOR_OFD_LIVENESS and liveness.flock_held(fd)

    # -- hot path ---------------------------------------------------------------

    def publish(self, snapshot: Snapshot) -> int:
        """Encode and publish one snapshot; returns its sequence number (0 if closed).

        A failure is counted in the header (`record_error`) and re-raised.
        """
        mm = self._mm
        if mm is None:
            return 0
        try:  # zero-cost in CPython 3.11+ until something raises
            self._encoder.encode_into(snapshot, self._buf)
        except Exception:
            self.record_error(layout.PUBLISH_ERR_ENCODE)
            raise
        try:
            return self._publish(mm, self._buf)
        except ValueError:  # the payload does not fit a slot
            self.record_error(layout.PUBLISH_ERR_TOO_LARGE)
            raise

    def record_error(self, code: int) -> None:
        """Count a failed publish in the header (publish_errors_total, last code and time).

        Outside the payload, so a reader sees it even if nothing was ever published. Never
        raises (a truncated segment is the publish's own error to report).
        """
        if self._mm is not None:
            try:
                _seqlock.record_error(self._mm, code)
            except (OSError, ValueError):
                pass

    def publish_bytes(self, payload: bytes | bytearray | memoryview) -> int:
        mm = self._mm
        if mm is None:
            return 0
        return self._publish(mm, payload)

    def heartbeat(self) -> None:
        """Refresh the heartbeat without a new snapshot (an idle engine is not a hung one)."""
        if self._mm is not None:
            _seqlock.heartbeat(self._mm)


def _install_lock(dir_fd: int, shm_dir: str, name: str) -> int:
    """Take ``.<name>.lock``: serializes writers installing or removing this name.

    0600, so no reader or other user can open (let alone hold) it. Unlinked by whoever
    releases it, so a holder re-checks that the path still names its inode.
    """
    path = f".{name}.lock"
    full = os.path.join(shm_dir, path)
    deadline = time.monotonic() + _INSTALL_LOCK_WAIT_S
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    while True:
        try:
            lfd = os.open(path, flags, 0o600, dir_fd=dir_fd)
        except OSError as e:
            _raise_foreign(full, dir_fd, path, e)
        st = os.fstat(lfd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            os.close(lfd)
            raise _squatted(full, st.st_uid)
        try:
            liveness.lock_for_life(lfd)
        except BlockingIOError:
            os.close(lfd)
            if time.monotonic() > deadline:
                raise SegmentBusyError(
                    f"segment {name}: another writer holds {full} (starting or "
                    "closing under this name): give this rank a distinct name or retry"
                ) from None
            time.sleep(0.001)
            continue
        try:
            same = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_ino == st.st_ino
        except FileNotFoundError:
            same = False
        if same:
            return lfd
        os.close(lfd)  # released and unlinked while we waited: take the new one


def _install_unlock(dir_fd: int, name: str, lfd: int) -> None:
    try:
        os.unlink(f".{name}.lock", dir_fd=dir_fd)
    except OSError:
        pass
    os.close(lfd)


def close_for_writers(shm_dir: str, pids: Collection[int], *, dead_only: bool = True) -> list[str]:
    """Do a writer's close() for it: mark CLOSED and unlink each segment in shm_dir whose
    header names one of pids as its writer, and whose writer lock nobody holds any more
    (``dead_only``) or is still held (``dead_only=False``).

    For a supervisor stopping its own children: vLLM's process manager SIGKILLs an engine
    core right after SIGTERM (``--shutdown-timeout 0``), before it can close its segment, and
    a stop would otherwise read as a crash. ``dead_only=False`` is for the moment just before
    such a kill: the writer must still be alive, so a writer that already crashed is never
    closed as if it had stopped cleanly (its segment must read dead). The caller passes only
    children it is stopping (alive when the stop began) with ``dead_only`` after the kill.
    Never touches another user's file or a name a new writer has taken since. Returns the
    names closed.
    """
    closed: list[str] = []
    if not pids:
        return closed
    try:
        dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return closed
    try:
        for name in os.listdir(dir_fd):
            if not name.startswith(".") and _close_for(dir_fd, shm_dir, name, pids, dead_only):
                closed.append(name)
    finally:
        os.close(dir_fd)
    return sorted(closed)


def _close_for(
    dir_fd: int, shm_dir: str, name: str, pids: Collection[int], dead_only: bool
) -> bool:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return False  # a symlink, FIFO, another user's file, gone: not ours to close
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        raw = os.pread(fd, layout.HEADER_LEN, 0)
        if len(raw) != layout.HEADER_LEN or raw[:8] not in _MAGICS:
            return False
        header = layout.Header(raw)  # writer_pid, state: the same offsets in both
        if header.writer_pid not in pids or header.state == layout.STATE_FAULTED:
            return False  # a faulted engine stopped by its supervisor still reads dead
        if liveness.write_locked(fd) == dead_only:  # dead_only: a live writer is left alone;
            return False  # else a dead one is (it crashed: never "closed cleanly" for it)
        try:
            lock = _install_lock(dir_fd, shm_dir, name)  # no successor is installing
        except (OSError, SegmentError):
            return False
        try:
            same = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == st.st_ino
            if not same or liveness.write_locked(fd) == dead_only:
                return False
            if os.pread(fd, 1, layout.OFF_STATE) == bytes([layout.STATE_FAULTED]):
                return False  # faulted since the first look
            os.pwrite(fd, bytes([layout.STATE_CLOSED]), layout.OFF_STATE)  # readers' maps see it
            os.unlink(name, dir_fd=dir_fd)
            return True
        except OSError:
            return False
        finally:
            _install_unlock(dir_fd, name, lock)
    finally:
        os.close(fd)


def _after_fork(ref: weakref.ref[SegmentWriter]) -> None:
    writer = ref()
    if writer is not None:
        writer._forget_in_child()


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no passwd entry"


def _squatted(path: str, uid: int) -> SegmentSquattedError:
    return SegmentSquattedError(
        f"{path} belongs to uid {uid} ({_user(uid)}), not to this engine's uid "
        f"{os.geteuid()}: another local user may be squatting it; remove it (as root or "
        f"that user) or set {SHM_DIR.name} to a directory only you can write "
        f"(the default {DEFAULT_SHM_DIR} is created {DEFAULT_SHM_DIR_MODE:o})"
    )


def _raise_foreign(full: str, dir_fd: int, path: str, e: OSError) -> None:
    """Turn an open() failure on one of our names into a one-line error naming the cause."""
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and st.st_uid != os.geteuid():
        raise _squatted(full, st.st_uid) from e
    if e.errno == errno.ELOOP:
        raise SegmentError(f"{full} is a symlink: refusing to follow it; remove it") from e
    raise SegmentError(f"cannot open {full}: {e.strerror}") from e


def _gid(group: str | int) -> int:
    """A group name, or a gid given as an int or as digits (KVSIDECAR_GROUP=2000)."""
    if isinstance(group, int):
        return group
    if group.isdigit():
        return int(group)
    return grp.getgrnam(group).gr_gid


def _open_dir(shm_dir: str, gid: int | None) -> int:
    """Open the shm directory (never through a symlink); create the default one privately.

    The default directory must belong to us or root: /dev/shm is world-writable, so
    anyone could otherwise create /dev/shm/kvsidecar first and own every name in it.
    """
    default = os.path.abspath(shm_dir) == DEFAULT_SHM_DIR
    created = False
    if default:
        try:
            os.mkdir(shm_dir, DEFAULT_SHM_DIR_MODE)
            created = True
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise SegmentError(
                f"{os.path.dirname(shm_dir)} does not exist: mount a tmpfs there or set "
                f"{SHM_DIR.name} to a tmpfs directory"
            ) from None
        except OSError as e:
            raise SegmentError(
                f"cannot create {shm_dir}: {e.strerror}; set {SHM_DIR.name} to a tmpfs "
                "directory you can write"
            ) from e
    try:
        dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SegmentError(
            f"shm directory {shm_dir} does not exist: create it or set "
            f"{SHM_DIR.name} to a tmpfs directory"
        ) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SegmentError(
                f"shm directory {shm_dir} is a symlink or not a directory: refused (another "
                f"user may have planted it); remove it or set {SHM_DIR.name}"
            ) from e
        raise SegmentError(f"cannot open shm directory {shm_dir}: {e.strerror}") from e
    try:
        st = os.fstat(dir_fd)
        if default and st.st_uid not in (os.geteuid(), 0):
            raise _squatted(shm_dir, st.st_uid)
        if created:
            # Exactly 0750 whatever the umask; keep a setgid bit inherited from the parent
            # (Kubernetes fsGroup volumes), so segments get the volume's group.
            os.fchmod(dir_fd, DEFAULT_SHM_DIR_MODE | (st.st_mode & stat.S_ISGID))
            if gid is not None:
                os.fchown(dir_fd, -1, gid)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


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
