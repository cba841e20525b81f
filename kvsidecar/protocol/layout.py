"""Byte layout of a kvsidecar segment. docs/segment-format.md is the long form.

All integers little-endian. Offsets are from the start of the file.

::

    0        8        16       24       32       40       48       56       64
    +--------+--+--+--+-+-+----+--------+--------+----+----+--------+----+----+
    | magic  |mj|mn|hl|s|n| total_size    | incarnation   | generation ...   |  line 0
    +--------+--+--+--+-+-+----+--------+--------+----+----+--------+----+----+
      0  magic[8]          "KVSCSEG1", written LAST when the file is created
      8  u16 layout_major  a reader refuses a different major
     10  u16 layout_minor  a reader accepts a newer minor (fields only appended)
     12  u16 header_len    256
     14  u8  state         0 INIT, 1 READY, 2 CLOSED, 3 FAULTED (v1.2)
     15  u8  n_slots       2
     16  u64 total_size    file size in bytes, a multiple of 4096
     24  u64 incarnation   random, non-zero, new for every writer start
     32  u64 generation    1 + generation of the segment this one replaced
     40  u32 writer_pid    informational (pids are per namespace)
     44  u32 writer_uid
     48  u64 start_wall_ns CLOCK_REALTIME when the writer started
     56  u32 dir_off       offset of the directory (msgpack Capabilities)
     60  u32 dir_len
     64  u64 published_seq line 1, alone: k => slot k&1 holds snapshot k; 0 = none
    128  u64 heartbeat_mono_ns   line 2: CLOCK_MONOTONIC at the last publish
    136  u64 heartbeat_wall_ns   CLOCK_REALTIME at the last publish
    192  u32 slot_off      line 3, static: offset of slot 0
    196  u32 slot_stride   bytes from slot 0 to slot 1 (multiple of 64)
    200  u32 slot_capacity max payload bytes per slot
    204  u32 dir_crc32     CRC-32 (zlib) of the directory bytes
    208  u64 publish_errors_total   v1.1: failed publishes (payload-independent)
    216  u32 last_publish_error     v1.1: code of the last failure (PUBLISH_ERRORS)
    220  u32 reserved
    224  u64 last_publish_error_mono_ns  v1.1: CLOCK_MONOTONIC of the last failure
    232..255 reserved, zero

    256      directory: dir_len bytes, padded to 64
    slot_off slot 0: u64 slot_seq | u32 payload_len | u32 payload_crc32 | payload ...
             slot 1 at slot_off + slot_stride, same shape

The payload is a msgpack array (schema.Snapshot, array_like); the directory
names its positions. The seqlock protocol is in _seqlock.c's header comment.
"""

from __future__ import annotations

import struct

from kvsidecar.protocol import _seqlock

MAGIC = b"KVSCSEG1"
LAYOUT_MAJOR = 1
# 1: publish-error fields at 208..231, liveness by an OFD write lock (a v1.0 writer only
# holds flock, which a reader can also take, so readers still flock-probe minor 0).
# 2: state 3 FAULTED (the engine reported a fatal error). A v1.1 reader reads it as any
# state but CLOSED: dead once the writer is gone, which is what FAULTED means.
LAYOUT_MINOR = 2
MINOR_OFD_LIVENESS = 1
HEADER_LEN = 256
PAGE = 4096
CACHE_LINE = 64
N_SLOTS = 2

OFF_MAGIC = 0
OFF_MAJOR = 8
OFF_MINOR = 10
OFF_HEADER_LEN = 12
OFF_STATE = 14
OFF_N_SLOTS = 15
OFF_TOTAL_SIZE = 16
OFF_INCARNATION = 24
OFF_GENERATION = 32
OFF_WRITER_PID = 40
OFF_WRITER_UID = 44
OFF_START_WALL_NS = 48
OFF_DIR_OFF = 56
OFF_DIR_LEN = 60
OFF_PUBLISHED_SEQ = 64
OFF_HEARTBEAT_MONO = 128
OFF_HEARTBEAT_WALL = 136
OFF_SLOT_OFF = 192
OFF_SLOT_STRIDE = 196
OFF_SLOT_CAPACITY = 200
OFF_DIR_CRC = 204
OFF_PUBLISH_ERRORS = 208
OFF_LAST_PUBLISH_ERROR = 216
OFF_LAST_PUBLISH_ERROR_MONO = 224

# Codes of last_publish_error. Written by the writer outside the payload, so a reader
# learns why publishing fails even when no snapshot was ever published.
PUBLISH_OK = 0
PUBLISH_ERR_ENCODE = 1  # a value the encoder cannot write (wrong type, int out of range)
PUBLISH_ERR_TOO_LARGE = 2  # the payload does not fit a slot (too many pools)
PUBLISH_ERR_POOL_SOURCE = 3  # a registered pool's snapshot() raised
PUBLISH_ERR_ARGUMENT = 4  # a step() argument is not a number
PUBLISH_ERR_OTHER = 5
PUBLISH_ERRORS = {
    PUBLISH_OK: "none",
    PUBLISH_ERR_ENCODE: "encode",
    PUBLISH_ERR_TOO_LARGE: "too_large",
    PUBLISH_ERR_POOL_SOURCE: "pool_source",
    PUBLISH_ERR_ARGUMENT: "bad_argument",
    PUBLISH_ERR_OTHER: "other",
}

SLOT_HEADER_LEN = 16  # u64 slot_seq, u32 payload_len, u32 payload_crc32

STATE_INIT = 0
STATE_READY = 1
STATE_CLOSED = 2  # the engine completed a normal shutdown: "closed cleanly"
# The engine hit a fatal error: dead at once, whatever the lock says, and never CLOSED
# after (a supervisor's stop that follows a fault must not read as a routine one).
STATE_FAULTED = 3
STATE_NAMES = {
    STATE_INIT: "init",
    STATE_READY: "ready",
    STATE_CLOSED: "closed",
    STATE_FAULTED: "faulted",
}

DEFAULT_SLOT_CAPACITY = 16 * 1024  # ~30 pools; a payload for 1 runtime + 4 pools is ~0.6 KB
MAX_SEGMENT_SIZE = 16 * 1024 * 1024  # readers refuse anything bigger (absurd-size guard)

# The C side has its own copies of the offsets it touches; they must agree.
assert _seqlock.OFF_PUBLISHED_SEQ == OFF_PUBLISHED_SEQ
assert _seqlock.OFF_HEARTBEAT_MONO == OFF_HEARTBEAT_MONO
assert _seqlock.OFF_HEARTBEAT_WALL == OFF_HEARTBEAT_WALL
assert _seqlock.OFF_SLOT_OFF == OFF_SLOT_OFF
assert _seqlock.OFF_SLOT_STRIDE == OFF_SLOT_STRIDE
assert _seqlock.OFF_SLOT_CAPACITY == OFF_SLOT_CAPACITY
assert _seqlock.SLOT_HEADER_LEN == SLOT_HEADER_LEN
assert _seqlock.OFF_PUBLISH_ERRORS == OFF_PUBLISH_ERRORS
assert _seqlock.OFF_LAST_PUBLISH_ERROR == OFF_LAST_PUBLISH_ERROR
assert _seqlock.OFF_LAST_PUBLISH_ERROR_MONO == OFF_LAST_PUBLISH_ERROR_MONO

# Static part of the header, 0..64 (published_seq and heartbeats are written separately).
_STATIC = struct.Struct("<8sHHHBBQQQIIQII")
_SLOTS = struct.Struct("<IIII")  # slot_off, slot_stride, slot_capacity, dir_crc32
_ERRORS = struct.Struct("<QI4xQ")  # publish_errors_total, last_publish_error, its mono ns
assert _STATIC.size == 64


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def plan(dir_len: int, slot_capacity: int = DEFAULT_SLOT_CAPACITY) -> tuple[int, int, int]:
    """Return (slot_off, slot_stride, total_size) for a directory and slot size."""
    slot_off = round_up(HEADER_LEN + dir_len, CACHE_LINE)
    slot_stride = round_up(SLOT_HEADER_LEN + slot_capacity, CACHE_LINE)
    total = round_up(slot_off + N_SLOTS * slot_stride, PAGE)
    return slot_off, slot_stride, total


class Header:
    """A decoded header (from a private copy of the first 256 bytes)."""

    __slots__ = (
        "dir_crc",
        "dir_len",
        "dir_off",
        "generation",
        "header_len",
        "heartbeat_mono_ns",
        "heartbeat_wall_ns",
        "incarnation",
        "last_publish_error",
        "last_publish_error_mono_ns",
        "magic",
        "major",
        "minor",
        "n_slots",
        "publish_errors_total",
        "published_seq",
        "slot_capacity",
        "slot_off",
        "slot_stride",
        "start_wall_ns",
        "state",
        "total_size",
        "writer_pid",
        "writer_uid",
    )

    def __init__(self, raw: bytes) -> None:
        (
            self.magic,
            self.major,
            self.minor,
            self.header_len,
            self.state,
            self.n_slots,
            self.total_size,
            self.incarnation,
            self.generation,
            self.writer_pid,
            self.writer_uid,
            self.start_wall_ns,
            self.dir_off,
            self.dir_len,
        ) = _STATIC.unpack_from(raw, 0)
        (self.published_seq,) = struct.unpack_from("<Q", raw, OFF_PUBLISHED_SEQ)
        self.heartbeat_mono_ns, self.heartbeat_wall_ns = struct.unpack_from(
            "<QQ", raw, OFF_HEARTBEAT_MONO
        )
        self.slot_off, self.slot_stride, self.slot_capacity, self.dir_crc = _SLOTS.unpack_from(
            raw, OFF_SLOT_OFF
        )
        # Zero in a v1.0 header (reserved bytes), so no minor check is needed.
        (
            self.publish_errors_total,
            self.last_publish_error,
            self.last_publish_error_mono_ns,
        ) = _ERRORS.unpack_from(raw, OFF_PUBLISH_ERRORS)


def pack_header(
    *,
    state: int,
    total_size: int,
    incarnation: int,
    generation: int,
    writer_pid: int,
    writer_uid: int,
    start_wall_ns: int,
    dir_off: int,
    dir_len: int,
    slot_off: int,
    slot_stride: int,
    slot_capacity: int,
    dir_crc: int,
    magic: bytes = MAGIC,
) -> bytes:
    """The full 256-byte header with published_seq and heartbeats zero."""
    raw = bytearray(HEADER_LEN)
    _STATIC.pack_into(
        raw,
        0,
        magic,
        LAYOUT_MAJOR,
        LAYOUT_MINOR,
        HEADER_LEN,
        state,
        N_SLOTS,
        total_size,
        incarnation,
        generation,
        writer_pid,
        writer_uid,
        start_wall_ns,
        dir_off,
        dir_len,
    )
    _SLOTS.pack_into(raw, OFF_SLOT_OFF, slot_off, slot_stride, slot_capacity, dir_crc)
    return bytes(raw)
