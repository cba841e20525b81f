"""The segment reader, used by the daemon and the CLI. Never writes, never blocks the writer.

``SegmentReader.attach()`` opens the file read-only (``O_RDONLY|O_NOFOLLOW``,
``PROT_READ``; never ``multiprocessing.shared_memory``, whose resource tracker
can unlink the engine's segment) and checks everything a corrupt or hostile
file could get wrong before any byte is trusted. ``read()`` copies the last
completed slot through the C latch (bounded retries, CRC) and decodes it.

Every failure is returned, not raised, as a `ReadError` subclass whose
message is one line naming the problem and the fix.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import sys
import time
import typing

import msgspec

from kvsidecar.protocol import _seqlock, layout, liveness
from kvsidecar.protocol.names import DEFAULT_SHM_DIR, InvalidName, segment_path
from kvsidecar.protocol.schema import (
    IDENTITY_FIELDS,
    SCHEMA_MAJOR,
    Capabilities,
    KVCachePoolSnapshot,
    RuntimeSnapshot,
    Snapshot,
    decode_capabilities,
    directory_version,
    field_order_error,
    unsent_count,
)

DEFAULT_RETRIES = 8
# Descriptors an attached reader holds: its own (fstat for truncation, the liveness lock
# probe) and, before Python 3.13, the duplicate CPython's mmap keeps for size() and
# resize(), which the reader never calls (3.13's trackfd=False makes none).
_MMAP_KWARGS: dict[str, bool] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
FDS_PER_SEGMENT = 1 if _MMAP_KWARGS else 2


class ReadError(Exception):
    """Base of every typed read error. ``kind`` is a stable short name for metrics."""

    kind = "error"


class NotFound(ReadError):
    kind = "not_found"


class NotReady(ReadError):
    """The writer has not published a snapshot yet, or the file is still being made."""

    kind = "not_ready"


class PublishFailing(NotReady):
    """Nothing published yet, and the header counts failed publishes: the agent is broken,
    not idle. ``publish_errors_total`` and ``last_publish_error`` (a name) say how."""

    kind = "publish_failing"

    def __init__(self, message: str, publish_errors_total: int, last_publish_error: str) -> None:
        super().__init__(message)
        self.publish_errors_total = publish_errors_total
        self.last_publish_error = last_publish_error


class Corrupt(ReadError):
    kind = "corrupt"


class VersionMismatch(ReadError):
    kind = "version_mismatch"


class Refused(ReadError):
    """Not a file we may read: symlink, FIFO, foreign owner, bad name, permissions."""

    kind = "refused"


class Contended(ReadError):
    """The writer lapped every retry (it publishes faster than we copy). Transient."""

    kind = "contended"


class Gone(ReadError):
    """The segment was unlinked or replaced since we attached: re-attach by name."""

    kind = "gone"


class _WithLast(ReadError):
    """An error that still has the last good snapshot (``last``) to offer."""

    def __init__(self, message: str, last: Reading | None = None) -> None:
        super().__init__(message)
        self.last = last


class WriterDead(_WithLast):
    """No process holds the writer lock; ``last`` is the last snapshot it published."""

    kind = "writer_dead"


class Faulted(WriterDead):
    """The writer marked the segment FAULTED: the engine hit a fatal error. Dead whether or
    not its process still holds the lock (it is being torn down, and publishes no more)."""

    kind = "faulted"


class Stale(_WithLast):
    """The writer is alive but its heartbeat is older than allowed (hung, SIGSTOPped)."""

    kind = "stale"


class Reading(msgspec.Struct, frozen=True):
    """One consistent snapshot and where it came from.

    A frozen Struct, not a frozen dataclass: built once per target per poll, and
    a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) was
    a fifth of ``read()``.
    """

    snapshot: Snapshot
    seq: int
    incarnation: int
    generation: int
    heartbeat_mono_ns: int
    heartbeat_wall_ns: int
    start_wall_ns: int
    writer_pid: int
    attempts: int
    state: int
    # Layout v1.1 header (0 from a v1.0 writer): publishes that failed, the last one's
    # reason (layout.PUBLISH_ERRORS) and CLOCK_MONOTONIC time. Independent of the payload.
    publish_errors_total: int = 0
    last_publish_error: str = "none"
    last_publish_error_mono_ns: int = 0
    # Fields ("runtime.<f>" / "pool.<f>") whose value had the wrong type: read as None.
    rejected: tuple[str, ...] = ()

    @property
    def publish_failing(self) -> bool:
        """The last failed publish is newer than the last heartbeat: the writer is failing
        right now (it steps, but cannot publish), not hung (segment-format.md section 2)."""
        return self.last_publish_error_mono_ns > self.heartbeat_mono_ns

    def age_seconds(self, now_mono_ns: int | None = None) -> float:
        now = time.monotonic_ns() if now_mono_ns is None else now_mono_ns
        return max(0.0, (now - self.heartbeat_mono_ns) / 1e9)


class MappedFile:
    """A read-only attachment to one file of the shm directory (one incarnation of it):
    what the snapshot and KV-event readers share. Subclasses set the attributes below
    in ``__init__`` and attach (`open_mapped`)."""

    name: str
    shm_dir: str
    _path: str | None
    fd: int
    mm: mmap.mmap | None
    inode: int

    @property
    def path(self) -> str:
        return self._path or segment_path(self.name, self.shm_dir)

    def replaced(self) -> bool:
        """True if the name now points to another file (restart) or to nothing (unlinked)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except (OSError, InvalidName):
            return True
        return st.st_ino != self.inode

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SegmentReader(MappedFile):
    """A read-only attachment to one segment (one incarnation of it)."""

    def __init__(
        self,
        name: str | None = None,
        *,
        shm_dir: str = DEFAULT_SHM_DIR,
        path: str | None = None,
        allowed_uids: frozenset[int] | None = None,
        retries: int = DEFAULT_RETRIES,
    ) -> None:
        self.name = name or (os.path.basename(path) if path else "")
        self.shm_dir = shm_dir
        self._path = path
        self.allowed_uids = allowed_uids
        self.retries = retries
        self.fd = -1
        self.mm: mmap.mmap | None = None
        self.inode = 0
        self.header: layout.Header | None = None
        self.capabilities: Capabilities | None = None
        # How many positions the directory names in a runtime and in a pool record: only
        # those are read (segment-format.md section 5). None while it names at least every
        # field this reader knows, the usual case, where the typed decode reads no other.
        self._named: tuple[int, int] | None = None
        self._decoder = msgspec.msgpack.Decoder(Snapshot)
        self.last_bytes: tuple[int, bytes, bytes] | None = None  # (seq, header, payload)

    # -- attach -----------------------------------------------------------------

    def attach(self) -> ReadError | None:
        """Open, validate and map. Returns None on success, else the error."""
        self.close()
        try:
            path = self.path
        except InvalidName as e:
            return Refused(str(e))
        opened = open_mapped(path, self.allowed_uids, layout.MAX_SEGMENT_SIZE, "kvsidecar segment")
        if isinstance(opened, ReadError):
            return opened
        fd, mm, st = opened
        raw = _seqlock.copy_range(mm, 0, layout.HEADER_LEN)
        error: ReadError | None = None
        caps = None
        if raw is None:
            error = Corrupt(f"{path} was truncated while attaching")
        else:
            header = layout.Header(raw)
            error = check_header(header, st.st_size, path)
            if error is None:
                caps, error = _read_directory(mm, header, path)
        if error is not None:
            mm.close()
            os.close(fd)
            return error
        self.fd, self.mm, self.inode = fd, mm, st.st_ino
        self.header, self.capabilities = header, caps
        named = (len(caps.runtime_fields), len(caps.pool_fields))
        known = (len(RuntimeSnapshot.__struct_fields__), len(KVCachePoolSnapshot.__struct_fields__))
        self._named = None if named[0] >= known[0] and named[1] >= known[1] else named
        return None

    # -- read -------------------------------------------------------------------

    def read(self, size_check: bool = True) -> Reading | ReadError:
        """Copy and decode the last completed snapshot (no liveness check). Without
        `size_check` the file is not fstat'ed first: a truncation then reads as the
        guarded copy's SIGBUS (the same error), one system call fewer."""
        mm = self.mm
        if mm is None:
            return NotReady(f"segment {self.name} is not attached")
        try:
            # The C side fstats self.fd first (truncated: TRUNCATED), then copies.
            fd = self.fd if size_check else -1
            status, seq, raw, payload, attempts = _seqlock.read_latest(mm, self.retries, fd)
        except OSError as e:
            return Gone(f"segment {self.name}: {e.strerror}")
        if status != _seqlock.OK:
            if status == _seqlock.NOT_PUBLISHED and raw is not None:
                failing = _publish_failing(layout.Header(raw), self.path)
                if failing is not None:
                    return failing
            return _status_error(status, self.path, attempts)
        (
            magic,
            major,
            state,
            incarnation,
            generation,
            pid,
            start_wall,
            hb_mono,
            hb_wall,
            errors,
            last_error,
            last_error_mono,
        ) = _READ_FIELDS.unpack_from(raw)
        if magic != layout.MAGIC or major != layout.LAYOUT_MAJOR:
            # Overwritten after we attached: re-run the attach checks for the message.
            return check_header(layout.Header(raw), len(mm), self.path) or Corrupt(
                f"segment {self.path}: header changed under the reader"
            )
        # One msgpack array [runtime, pools, ...]: `[runtime]` alone is not a snapshot. The
        # usual header (a fixarray of 2..15) is one comparison; others are parsed.
        if not (payload and 0x92 <= payload[0] <= 0x9F):
            n = array_len(payload)
            if n is None or n < 2:
                return Corrupt(f"segment {self.path}: payload is not a [runtime, pools] array")
        rejected: tuple[str, ...] = ()
        unsent = unsent_count()
        try:
            snapshot = self._decoder.decode(payload)
            # A record cut short got the writer's defaults (engine "unknown", pid 0) where
            # nothing was sent (schema._Unsent), and a directory naming fewer fields than
            # this reader knows leaves values with no name, which the typed decode read:
            # read it field by field instead (the typed decode still ran: its budget).
            complete = unsent_count() == unsent and self._named is None
        except msgspec.ValidationError:
            complete = False  # a value of the wrong type
        except msgspec.DecodeError as e:
            return Corrupt(f"segment {self.path}: payload does not decode ({_one_line(e)})")
        # The bytes of a snapshot read whole by the typed decode: what a compiled check of
        # the next step compares against (kvsidecar.daemon.gateway_step).
        self.last_bytes = (seq, raw, payload) if complete else None
        if not complete:
            # Only the wrong or missing value is null (schema.md, "Values"), unless it is
            # an identity field.
            lenient = decode_lenient(payload, self._named)
            if isinstance(lenient, str):
                return Corrupt(f"segment {self.path}: payload does not decode ({lenient})")
            snapshot, rejected = lenient
        return Reading(
            snapshot=snapshot,
            seq=seq,
            incarnation=incarnation,
            generation=generation,
            heartbeat_mono_ns=hb_mono,
            heartbeat_wall_ns=hb_wall,
            start_wall_ns=start_wall,
            writer_pid=pid,
            attempts=attempts,
            state=state,
            publish_errors_total=errors,
            last_publish_error=_error_name(last_error),
            last_publish_error_mono_ns=last_error_mono,
            rejected=rejected,
        )

    # -- liveness ----------------------------------------------------------------

    def writer_alive(self) -> bool:
        """Lock probe: a v1.1 writer holds an OFD write lock for its life, which no reader
        can take (so none can fake a live writer); a v1.0 writer only holds flock."""
        if self.fd < 0:
            return False
        try:
            if self.header is not None and self.header.minor < layout.MINOR_OFD_LIVENESS:
                return liveness.flock_held(self.fd)
            return liveness.write_locked(self.fd)
        except OSError:
            return False


def open_for_reading(path: str) -> int | ReadError:
    """``O_RDONLY|O_NOFOLLOW|O_NONBLOCK``: the descriptor, or why not (one line)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return NotFound(f"segment {path} not found: is the engine's agent running?")
    except OSError as e:
        if e.errno == errno.ELOOP:
            return Refused(f"{path} is a symlink: refused (segments are never followed)")
        if e.errno == errno.EACCES:
            return Refused(
                f"permission denied on {path}: run the daemon in the engine's group "
                "(segments are 0640)"
            )
        return Refused(f"cannot open {path}: {e.strerror}")


def open_mapped(
    path: str, allowed_uids: frozenset[int] | None, max_size: int, what: str
) -> tuple[int, mmap.mmap, os.stat_result] | ReadError:
    """Open read-only, check the file (regular, owner, a size between a page and max_size)
    and map exactly its size with PROT_READ: (fd, map, stat), or why not (fd closed)."""
    fd = open_for_reading(path)
    if isinstance(fd, ReadError):
        return fd
    st = os.fstat(fd)
    error = file_refusal(st, path, allowed_uids)
    if error is None and st.st_size == 0:
        error = NotReady(f"{path} is empty (a writer died while creating it?)")
    elif error is None and not layout.PAGE <= st.st_size <= max_size:
        error = Corrupt(f"{path} has an impossible size {st.st_size}: not a {what}")
    if error is None:
        try:
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, access=mmap.ACCESS_READ, **_MMAP_KWARGS)
        except (OSError, ValueError) as e:
            error = Refused(f"cannot map {path}: {e}")
    if error is not None:
        os.close(fd)
        return error
    return fd, mm, st


def file_refusal(
    st: os.stat_result, path: str, allowed_uids: frozenset[int] | None
) -> ReadError | None:
    """A file that is not regular, or whose owner is not allowed: refused, with why."""
    if not stat.S_ISREG(st.st_mode):
        return Refused(f"{path} is not a regular file (FIFO/device?): refused")
    if allowed_uids is not None and st.st_uid not in allowed_uids:
        return Refused(
            f"{path} is owned by uid {st.st_uid}, not an allowed writer: "
            "pass --allow-uid to trust it"
        )
    return None


def array_len(raw: bytes | memoryview) -> int | None:
    """Element count of a msgpack array from its header; None if it is not an array."""
    if not raw:
        return None
    b = raw[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if b == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    return None


_HINTS = {rec: typing.get_type_hints(rec) for rec in (RuntimeSnapshot, KVCachePoolSnapshot)}


def _lenient_record(
    record: type[msgspec.Struct], values: object, prefix: str, rejected: list[str]
) -> msgspec.Struct | str:
    if not isinstance(values, list):
        return f"a {prefix.rstrip('.')} record is {type(values).__name__}, not an array"
    hints = _HINTS[record]
    kwargs: dict[str, object] = {}
    for name in record.__struct_fields__[len(values) :]:
        # Past the record's end: not sent, so null (unsupported), never the default; an
        # identity field cannot be null, so the record names no rank or pool.
        if name in IDENTITY_FIELDS or hints[name] is str:
            return f"{prefix}{name} is missing: the record has {len(values)} fields"
        kwargs[name] = None
    for name, value in zip(record.__struct_fields__, values):
        try:
            kwargs[name] = msgspec.convert(value, hints[name])
        except msgspec.ValidationError:
            if name in IDENTITY_FIELDS or hints[name] in (str, str | None):
                return f"{prefix}{name} is {type(value).__name__}, not {hints[name]}"
            kwargs[name] = None
            rejected.append(prefix + name)
    return record(**kwargs)


def _lenient_named(
    record: type[msgspec.Struct], values: object, n: int | None, prefix: str, rejected: list[str]
) -> msgspec.Struct | str:
    """`_lenient_record` of the values the directory names (its first n; all: None)."""
    if n is None or not isinstance(values, list) or len(values) <= n:
        return _lenient_record(record, values, prefix, rejected)
    got = _lenient_record(record, values[:n], prefix, rejected)
    if isinstance(got, str):
        return f"{got} named by the directory, of {len(values)} values"
    return got


def decode_lenient(
    payload: bytes | memoryview, named: tuple[int, int] | None = None
) -> tuple[Snapshot, tuple[str, ...]] | str:
    """Decode a payload field by field: each value of the wrong type becomes None and is
    named in the tuple, each field past a record's end is None (not named: unsent); a
    wrong structure, or an identity field wrong or missing, is the error. ``named``: how
    many positions the directory names in a runtime and a pool record; a record ends
    at its last named value (segment-format.md section 5: a value with no name is not
    read, so zipping names and decoding by position agree)."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        return _one_line(e)
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        return "not a [runtime, pools] array"
    rejected: list[str] = []
    n_runtime, n_pool = named or (None, None)
    runtime = _lenient_named(RuntimeSnapshot, obj[0], n_runtime, "runtime.", rejected)
    if isinstance(runtime, str):
        return runtime
    pools = []
    for values in obj[1]:
        pool = _lenient_named(KVCachePoolSnapshot, values, n_pool, "pool.", rejected)
        if isinstance(pool, str):
            return pool
        pools.append(pool)
    return Snapshot(runtime=runtime, pools=pools), tuple(rejected)  # type: ignore[arg-type]


def _fields_struct(fields: list[tuple[int, str]]) -> struct.Struct:
    """One Struct that picks (offset, format code) fields out of the header, padding between."""
    fmt, at = "<", 0
    for offset, code in fields:
        if offset < at:
            raise ValueError(f"header fields must be in offset order (offset {offset} < {at})")
        fmt += f"{offset - at}x{code}" if offset > at else code
        at = offset + struct.calcsize("<" + code)
    return struct.Struct(fmt)


# What read() needs from the header, in one unpack instead of layout.Header's
# three unpacks and 21 attribute stores (tests/protocol/test_read_path.py checks
# it against layout.Header).
_READ_FIELDS = _fields_struct(
    [
        (layout.OFF_MAGIC, "8s"),
        (layout.OFF_MAJOR, "H"),
        (layout.OFF_STATE, "B"),
        (layout.OFF_INCARNATION, "Q"),
        (layout.OFF_GENERATION, "Q"),
        (layout.OFF_WRITER_PID, "I"),
        (layout.OFF_START_WALL_NS, "Q"),
        (layout.OFF_HEARTBEAT_MONO, "Q"),
        (layout.OFF_HEARTBEAT_WALL, "Q"),
        (layout.OFF_PUBLISH_ERRORS, "Q"),
        (layout.OFF_LAST_PUBLISH_ERROR, "I"),
        (layout.OFF_LAST_PUBLISH_ERROR_MONO, "Q"),
    ]
)


def check_header(header: layout.Header, file_size: int, path: str) -> ReadError | None:
    """Every size and offset in the header checked against the file before use."""
    if header.magic != layout.MAGIC:
        if header.magic == b"\0" * 8:
            return NotReady(f"{path} is still being created (no magic yet)")
        return Corrupt(f"{path} has bad magic {header.magic!r}: not a kvsidecar segment")
    if header.major != layout.LAYOUT_MAJOR:
        return VersionMismatch(
            f"{path} has segment layout v{header.major}.{header.minor}; this daemon reads "
            f"v{layout.LAYOUT_MAJOR}.x: upgrade kvsidecar on the daemon side"
        )
    if header.header_len < layout.HEADER_LEN or header.header_len > layout.PAGE:
        return Corrupt(f"{path}: header_len {header.header_len} is impossible")
    if header.total_size != file_size:
        return Corrupt(f"{path}: header says {header.total_size} bytes, file has {file_size}")
    if header.n_slots != layout.N_SLOTS:
        return Corrupt(f"{path}: {header.n_slots} slots, expected {layout.N_SLOTS}")
    if not (header.header_len <= header.dir_off and header.dir_off + header.dir_len <= file_size):
        return Corrupt(f"{path}: directory at {header.dir_off}+{header.dir_len} is out of bounds")
    slot_end = header.slot_off + layout.N_SLOTS * header.slot_stride
    if (
        header.slot_off < header.dir_off + header.dir_len
        or header.slot_stride < layout.SLOT_HEADER_LEN + header.slot_capacity
        or slot_end > file_size
    ):
        return Corrupt(
            f"{path}: slot layout {header.slot_off}/{header.slot_stride} is out of bounds"
        )
    return None


def _read_directory(
    mm: mmap.mmap, header: layout.Header, path: str
) -> tuple[Capabilities | None, ReadError | None]:
    raw = _seqlock.copy_range(mm, header.dir_off, header.dir_len)
    if raw is None:
        return None, Corrupt(f"{path} was truncated while reading its directory")
    if _seqlock.crc32(raw) != header.dir_crc:
        return None, Corrupt(f"{path}: directory CRC mismatch")
    try:
        major, minor = directory_version(raw)
        if major == SCHEMA_MAJOR:
            caps = decode_capabilities(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return None, Corrupt(f"{path}: directory does not decode ({_one_line(e)})")
    if major != SCHEMA_MAJOR:
        return None, VersionMismatch(
            f"{path} carries schema v{major}.{minor}; this daemon reads "
            f"v{SCHEMA_MAJOR}.x: upgrade kvsidecar on the daemon side"
        )
    wrong = field_order_error(caps)
    if wrong is not None:
        return None, Corrupt(f"{path}: directory {wrong} (fields reordered within a major)")
    return caps, None


def _error_name(code: int) -> str:
    return layout.PUBLISH_ERRORS.get(code, f"code_{code}")


def _publish_failing(header: layout.Header, path: str) -> PublishFailing | None:
    if header.publish_errors_total == 0:
        return None
    why = _error_name(header.last_publish_error)
    return PublishFailing(
        f"segment {path} has no snapshot yet: the agent counted "
        f"{header.publish_errors_total} failed publishes (last: {why}); see the engine's log",
        header.publish_errors_total,
        why,
    )


def _status_error(status: int, path: str, attempts: int) -> ReadError:
    if status == _seqlock.NOT_PUBLISHED:
        return NotReady(f"segment {path} has no snapshot yet (engine not stepping?)")
    if status in (_seqlock.SIGBUS, _seqlock.TRUNCATED):
        return Corrupt(f"segment {path} was truncated under the reader")
    if status == _seqlock.BAD_LAYOUT:
        return Corrupt(f"segment {path}: slot layout out of bounds")
    if status == _seqlock.BAD_CRC:
        return Corrupt(f"segment {path}: slot CRC mismatch on {attempts} attempts")
    if status == _seqlock.BAD_SLOT:
        return Corrupt(f"segment {path}: slot header inconsistent on {attempts} attempts")
    return Contended(f"segment {path}: writer lapped the reader {attempts} times; will retry")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def read_segment(
    name: str,
    *,
    shm_dir: str = DEFAULT_SHM_DIR,
    stale_after: float | None = None,
    allowed_uids: frozenset[int] | None = None,
) -> Reading | ReadError:
    """One-shot read with liveness: a typed snapshot, or a typed error.

    A dead or stale writer yields `WriterDead`/`Stale` carrying the last good
    snapshot in ``.last``.
    """
    with SegmentReader(name, shm_dir=shm_dir, allowed_uids=allowed_uids) as reader:
        error = reader.attach()
        if error is not None:
            return error
        result = reader.read()
        last = result if isinstance(result, Reading) else None
        state = state_byte(reader)
        if state == layout.STATE_FAULTED:
            return Faulted(faulted_message(name, reader.writer_alive()), last)
        if not reader.writer_alive():
            return WriterDead(dead_message(name, state == layout.STATE_CLOSED), last)
        if last is not None and stale_after is not None and last.age_seconds() > stale_after:
            return Stale(stale_message(name, last, last.age_seconds(), stale_after), last)
        return result


def dead_message(name: str, closed: bool) -> str:
    """No writer holds the lock: closed cleanly if the state byte says CLOSED (whether or
    not the file is still there), else the writer died."""
    if closed:
        return f"segment {name}: closed cleanly by its writer (engine shut down)"
    return f"segment {name}: writer is gone (no process holds its lock)"


def faulted_message(name: str, alive: bool) -> str:
    """The state byte says FAULTED: the engine's own fatal-error path marked it."""
    tail = "its process is still being torn down" if alive else "its writer is gone"
    return f"segment {name}: the engine reported a fatal error (state FAULTED; {tail})"


def stale_message(name: str, reading: Reading, age: float, stale_after: float) -> str:
    """Why a live writer's heartbeat is old: failing publishes, or a hung engine."""
    head = f"segment {name}: heartbeat not advanced for {age:.1f}s (> {stale_after}s)"
    if reading.publish_failing:
        return (
            f"{head}: the engine steps but every publish fails ("
            f"{reading.publish_errors_total} failed, last: {reading.last_publish_error}); "
            "see the engine's log"
        )
    return f"{head}: engine hung or stopped"


def state_byte(reader: SegmentReader) -> int:
    """The mapped segment's state byte (INIT if unmapped); a guarded copy, never a SIGBUS."""
    raw = _seqlock.copy_range(reader.mm, layout.OFF_STATE, 1) if reader.mm else None
    return raw[0] if raw else layout.STATE_INIT
