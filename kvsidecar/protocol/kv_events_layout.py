"""Byte layout of a KV-event segment. docs/segment-format.md, "KV-event segment", is the
long form.

A second file per rank, beside the snapshot segment: the engine's prefix cache as a
table indexed by slot (the agent's block id: the true set of cached blocks) plus a ring
of change records in order (stored / removed / cleared). The agent writes both with one
C call per event (``_seqlock.kv_stored`` / ``kv_removed``; ``kv_commit`` for a clear):
no encoding, no system call, no lock, no
allocation, never waiting on a reader. The daemon turns them into vLLM's wire.

All integers little-endian. Offsets are from the start of the file.

::

      0  magic[8]          "KVSCEVT1", written LAST when the file is created
      8  u16 layout_major  1; a reader refuses another
     10  u16 layout_minor  0
     12  u16 header_len    256
     14  u8  state         1 READY, 2 CLOSED (as the snapshot segment)
     15  u8  reserved
     16  u64 total_size    file size, a multiple of 4096
     24  u64 incarnation   random, non-zero, new for every writer start
     32  u64 generation    1 + generation of the file this one replaced
     40  u32 writer_pid    informational
     44  u32 writer_uid    informational
     48  u64 start_wall_ns CLOCK_REALTIME when the writer started
     56  u32 n_slots       table slots (the pool's block ids: 0 .. n_slots-1)
     60  u32 slot_stride   bytes per slot, a multiple of 8
     64  u64 head          line 1, alone: number of the last ring record written; 0 = none
    128  u64 clear_epoch   line 2: bumped by each clear; a slot is cached iff its CACHED
                           flag is set and its epoch equals this
    192  u32 block_size    line 3, static: token ids per slot (the largest block)
    196  u32 ring_cap      records in the ring, a power of two
    200  u32 ring_off      offset of the ring (a multiple of 64)
    204  u32 table_off     offset of slot 0 (a multiple of 64)
    208  u32 record_size   32
    212  u32 dp_rank       the engine's data-parallel rank (the publisher's port offset)
    216  u32 names_off     offset of the LoRA-name table (a multiple of 64)
    220  u32 names_count   entries in it (index 0 = no name, never written)
    224..255 reserved, zero

A slot (``slot_stride`` bytes, a seqlock of its own)::

     +0  u64 seq           odd while the writer rewrites the slot; even otherwise
     +8  u64 version       stores into this slot so far (a removal keeps it)
    +16  u64 block_hash    the engine's hash, unsigned (vLLM: the low 64 bits; SGLang:
                           the 64 bits of its signed hash)
    +24  u64 parent_hash   valid when HAS_PARENT
    +32  u32 epoch         clear_epoch when stored
    +36  u8  flags         CACHED 1, HAS_PARENT 2, HAS_LORA_ID 4
    +37  u8  medium        0 none, 1 GPU, 2 CPU, 3 STORAGE
    +38  u16 group_idx     KV-cache group
    +40  u16 n_tokens      token ids that follow (<= block_size)
    +42  u16 lora_name     index into the name table, 0 = none
    +44  u16 spec          index into the name table of the group's KV-cache spec
                           ("<kind>" or "<kind> <sliding_window>"), 0 = none
    +46  u16 reserved
    +48  i64 lora_id       valid when HAS_LORA_ID
    +56  u32 token_ids[block_size]

A ring record (32 bytes; record n at ``ring_off + ((n - 1) % ring_cap) * 32``)::

     +0  u64 seq           n (a check: a reader expects it)
     +8  u8  kind          1 STORED, 2 REMOVED, 3 CLEARED
     +9  u8  flags         FIRST 1: this stored block starts a new BlockStored event
    +10  u16 group_idx
    +12  u32 slot
    +16  u64 version       the slot's version this record is about
    +24  u64 block_hash

A name-table entry (64 bytes): u64 seq (a seqlock, like a slot), u16 length, 54 bytes of
UTF-8. Written once, before any slot names it.
"""

from __future__ import annotations

import struct

from kvsidecar.protocol import _seqlock, layout

MAGIC = b"KVSCEVT1"
LAYOUT_MAJOR = 1
LAYOUT_MINOR = 0
HEADER_LEN = 256

# Line 0 is the snapshot segment's (layout.py) up to offset 56: magic, versions, state,
# size, incarnation, generation, pid, uid, start time. The creation, liveness, install and
# close code (writer.SegmentFile) relies on that.
OFF_STATE = layout.OFF_STATE
OFF_INCARNATION = layout.OFF_INCARNATION
OFF_GENERATION = layout.OFF_GENERATION
OFF_N_SLOTS = 56
OFF_SLOT_STRIDE = 60
OFF_HEAD = 64
OFF_CLEAR_EPOCH = 128
OFF_BLOCK_SIZE = 192
OFF_RING_CAP = 196
OFF_RING_OFF = 200
OFF_TABLE_OFF = 204
OFF_RECORD_SIZE = 208
OFF_DP_RANK = 212
OFF_NAMES_OFF = 216
OFF_NAMES_COUNT = 220

# A slot
SLOT_FIXED = 56  # bytes before the token ids
SLOT_OFF_FLAGS = 36
assert _seqlock.KV_SLOT_FLAGS_AT == SLOT_OFF_FLAGS
FLAG_CACHED = 1
FLAG_HAS_PARENT = 2
FLAG_HAS_LORA_ID = 4
# The slot's fields after seq (offset 8 .. 56), packed as one struct by the writer.
SLOT_BODY = struct.Struct("<QQQIBBHHHHHq")
assert SLOT_BODY.size == SLOT_FIXED - 8
SLOT_HEAD = struct.Struct("<Q" + SLOT_BODY.format[1:])  # seq + body, for readers

MEDIA = {0: None, 1: "GPU", 2: "CPU", 3: "STORAGE"}
MEDIUM_CODES = {v: k for k, v in MEDIA.items()}

# A ring record
RECORD = struct.Struct("<QBBHIQQ")
RECORD_SIZE = RECORD.size
assert RECORD_SIZE == 32
KIND_STORED = 1
KIND_REMOVED = 2
KIND_CLEARED = 3
KIND_NAMES = {KIND_STORED: "stored", KIND_REMOVED: "removed", KIND_CLEARED: "cleared"}
REC_FIRST = 1

# The LoRA-name table
NAME_ENTRY = 64
NAME_MAX_BYTES = NAME_ENTRY - 10
DEFAULT_NAMES = 64

DEFAULT_RING_CAP = 1 << 16  # 65,536 changes (2 MiB): seconds of a busy engine's churn
MAX_BLOCK_SIZE = 4096
# A reader refuses a file larger than this (absurd-size guard): 1M blocks of 256 tokens.
MAX_TOTAL_SIZE = 1 << 31

_STATIC = struct.Struct("<8sHHHBBQQQIIQII")  # line 0, the same shape as layout._STATIC
_GEOMETRY = struct.Struct("<IIIIIIII")  # 192: block_size .. names_count
assert _STATIC.size == 64


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_stride(block_size: int) -> int:
    return round_up(SLOT_FIXED + 4 * block_size, 8)


class Geometry:
    """Where everything is, from n_slots, block_size, ring_cap and names_count."""

    __slots__ = (
        "block_size",
        "n_slots",
        "names_count",
        "names_off",
        "ring_cap",
        "ring_off",
        "slot_stride",
        "table_off",
        "total_size",
    )

    def __init__(self, n_slots: int, block_size: int, ring_cap: int, names_count: int) -> None:
        self.n_slots = n_slots
        self.block_size = block_size
        self.ring_cap = ring_cap
        self.names_count = names_count
        self.slot_stride = slot_stride(block_size)
        self.ring_off = HEADER_LEN
        self.names_off = round_up(self.ring_off + ring_cap * RECORD_SIZE, 64)
        self.table_off = round_up(self.names_off + names_count * NAME_ENTRY, 64)
        self.total_size = round_up(self.table_off + n_slots * self.slot_stride, layout.PAGE)

    def slot_off(self, slot: int) -> int:
        return self.table_off + slot * self.slot_stride

    def record_off(self, n: int) -> int:
        return self.ring_off + ((n - 1) & (self.ring_cap - 1)) * RECORD_SIZE

    def name_off(self, index: int) -> int:
        return self.names_off + index * NAME_ENTRY


def geometry_error(
    n_slots: int, block_size: int, ring_cap: int, names_count: int, total: int
) -> str | None:
    """Why these numbers (from a header, or asked of a writer) are not a valid file."""
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        return f"block_size {block_size} not in 1..{MAX_BLOCK_SIZE}"
    if ring_cap < 2 or ring_cap & (ring_cap - 1) or ring_cap > 1 << 24:
        return f"ring_cap {ring_cap} is not a power of two in 2..{1 << 24}"
    if not 0 <= n_slots < 1 << 31:
        return f"n_slots {n_slots} out of range"
    if not 1 <= names_count <= 4096:
        return f"names_count {names_count} not in 1..4096"
    need = Geometry(n_slots, block_size, ring_cap, names_count).total_size
    if need > MAX_TOTAL_SIZE:
        return f"a {need}-byte file > {MAX_TOTAL_SIZE}: fewer blocks or a smaller block size"
    if total != need:
        return f"total_size {total} != {need}, the size its geometry needs"
    return None


class Header:
    """A decoded header (from a private copy of the first 256 bytes)."""

    __slots__ = (
        "block_size",
        "clear_epoch",
        "dp_rank",
        "generation",
        "head",
        "header_len",
        "incarnation",
        "magic",
        "major",
        "minor",
        "n_slots",
        "names_count",
        "names_off",
        "record_size",
        "ring_cap",
        "ring_off",
        "slot_stride",
        "start_wall_ns",
        "state",
        "table_off",
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
            _,
            self.total_size,
            self.incarnation,
            self.generation,
            self.writer_pid,
            self.writer_uid,
            self.start_wall_ns,
            self.n_slots,
            self.slot_stride,
        ) = _STATIC.unpack_from(raw, 0)
        (self.head,) = struct.unpack_from("<Q", raw, OFF_HEAD)
        (self.clear_epoch,) = struct.unpack_from("<Q", raw, OFF_CLEAR_EPOCH)
        (
            self.block_size,
            self.ring_cap,
            self.ring_off,
            self.table_off,
            self.record_size,
            self.dp_rank,
            self.names_off,
            self.names_count,
        ) = _GEOMETRY.unpack_from(raw, OFF_BLOCK_SIZE)

    def geometry(self) -> Geometry:
        return Geometry(self.n_slots, self.block_size, self.ring_cap, self.names_count)


def pack_header(
    *,
    geometry: Geometry,
    incarnation: int,
    generation: int,
    writer_pid: int,
    writer_uid: int,
    start_wall_ns: int,
    dp_rank: int,
    magic: bytes = MAGIC,
) -> bytes:
    g = geometry
    raw = bytearray(HEADER_LEN)
    _STATIC.pack_into(
        raw,
        0,
        magic,
        LAYOUT_MAJOR,
        LAYOUT_MINOR,
        HEADER_LEN,
        layout.STATE_READY,
        0,
        g.total_size,
        incarnation,
        generation,
        writer_pid,
        writer_uid,
        start_wall_ns,
        g.n_slots,
        g.slot_stride,
    )
    _GEOMETRY.pack_into(
        raw,
        OFF_BLOCK_SIZE,
        g.block_size,
        g.ring_cap,
        g.ring_off,
        g.table_off,
        RECORD_SIZE,
        dp_rank,
        g.names_off,
        g.names_count,
    )
    return bytes(raw)


def events_name(segment_name: str) -> str:
    """The KV-event file's name for a snapshot segment's name: ``kvsidecar.`` becomes
    ``kvevents.`` (so snapshot discovery, by the prefix ``kvsidecar.``, never picks it up);
    any other name gets ``kvevents.`` in front."""
    head = "kvsidecar."
    if segment_name.startswith(head):
        return EVENTS_PREFIX + segment_name[len(head) :]
    return EVENTS_PREFIX + segment_name


EVENTS_PREFIX = "kvevents."
