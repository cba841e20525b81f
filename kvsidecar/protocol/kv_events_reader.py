"""The KV-event segment's reader (the daemon's publisher and ``kvsidecar events``).

Read-only, like `reader.SegmentReader`: the same open (``O_NOFOLLOW``, regular file,
owner check) and a ``PROT_READ`` map, so a reader can never disturb the writer. Three
reads, each through the C side's fences (docs/segment-format.md, "KV-event segment"):

* `records(first)`: ring records from number ``first`` on, or `Overrun` when the
  writer has overwritten ``first`` (the reader lost its place: rebuild from the table);
* `cached_blocks()`: the table's cached blocks and the head loaded *before* the scan,
  so replaying the ring after that head on top of the scan gives the true state;
* `block(slot)`: one slot, consistent under its seqlock.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from typing import NamedTuple

from kvsidecar.protocol import _seqlock, liveness
from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.names import DEFAULT_SHM_DIR, InvalidName
from kvsidecar.protocol.reader import (
    Corrupt,
    MappedFile,
    NotReady,
    ReadError,
    VersionMismatch,
    open_mapped,
)

SLOT_RETRIES = 64
SCAN_CHUNK = 16384


class Overrun(ReadError):
    """The writer has overwritten the record the reader wanted next: it lost its place."""

    kind = "overrun"

    def __init__(self, message: str, head: int) -> None:
        super().__init__(message)
        self.head = head


class Record(NamedTuple):
    seq: int
    kind: int
    flags: int
    group_idx: int
    slot: int
    version: int
    block_hash: int


class Block(NamedTuple):
    slot: int
    version: int
    block_hash: int
    parent_hash: int | None
    cached: bool
    epoch: int
    medium: str | None
    group_idx: int
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: int  # index into the name table (KVEventsReader.lora_name), 0 = none
    spec: int  # the KV-cache spec's index into the name table, 0 = none


class KVEventsReader(MappedFile):
    """A read-only attachment to one KV-event segment (one incarnation of it)."""

    def __init__(
        self,
        name: str | None = None,
        *,
        shm_dir: str = DEFAULT_SHM_DIR,
        path: str | None = None,
        allowed_uids: frozenset[int] | None = None,
    ) -> None:
        self.name = name or (os.path.basename(path) if path else "")
        self.shm_dir = shm_dir
        self._path = path
        self.allowed_uids = allowed_uids
        self.fd = -1
        self.mm: mmap.mmap | None = None
        self.inode = 0
        self.header: kvl.Header | None = None
        self.geometry: kvl.Geometry | None = None
        self._names: dict[int, str | None] = {0: None}

    @property
    def incarnation(self) -> int:
        return self.header.incarnation if self.header is not None else 0

    def attach(self) -> ReadError | None:
        """Open, validate and map. Returns None on success, else the error."""
        self.close()
        try:
            path = self.path
        except InvalidName as e:
            return ReadError(str(e))
        opened = open_mapped(path, self.allowed_uids, kvl.MAX_TOTAL_SIZE, "KV-event segment")
        if isinstance(opened, ReadError):
            return opened
        fd, mm, st = opened
        raw = _seqlock.copy_range(mm, 0, kvl.HEADER_LEN)
        if raw is None:
            error: ReadError | None = Corrupt(f"{path} was truncated while attaching")
        else:
            header = kvl.Header(raw)
            error = check_header(header, st.st_size, path)
        if error is not None:
            mm.close()
            os.close(fd)
            return error
        self.fd, self.mm, self.inode = fd, mm, st.st_ino
        self.header, self.geometry = header, header.geometry()
        return None

    # -- reads --------------------------------------------------------------------

    def head(self) -> int:
        """The number of the last record written (acquire: what it covers is visible)."""
        return _seqlock.kv_load_u64(self._map(), kvl.OFF_HEAD)

    def epoch(self) -> int:
        return _seqlock.kv_load_u64(self._map(), kvl.OFF_CLEAR_EPOCH)

    def records(self, first: int, max_n: int = 4096) -> list[Record]:
        """Records first, first+1, ... (at most max_n, up to the head). Raises `Overrun`
        if the writer overwrote any of them (or first is older than the ring)."""
        g = self.geometry
        assert g is not None
        head, intact, data = _seqlock.kv_ring_read(
            self._map(), kvl.OFF_HEAD, g.ring_off, kvl.RECORD_SIZE, g.ring_cap, first, max_n
        )
        if first < intact:
            raise Overrun(
                f"{self.name}: record {first} was overwritten (head {head}, ring "
                f"{g.ring_cap}): rebuild from the table",
                head,
            )
        out = [Record(*r) for r in kvl.RECORD.iter_unpack(data)]
        for i, r in enumerate(out):
            if r.seq != first + i:
                raise Corrupt(f"{self.name}: ring record {first + i} holds number {r.seq}")
        return out

    def block(self, slot: int) -> Block | None:
        """One slot, consistent; None if every attempt met the writer mid-write."""
        g = self.geometry
        assert g is not None
        raw = _seqlock.kv_slot_read(self._map(), g.slot_off(slot), g.slot_stride, SLOT_RETRIES)
        return None if raw is None else self._decode(slot, raw)

    def slot_row(self, slot: int) -> bytes | None:
        """One slot's copy as `cached_rows` gives them (its number in the first 8 bytes),
        cached or not; None if every attempt met the writer mid-write."""
        g = self.geometry
        assert g is not None
        raw = _seqlock.kv_slot_read(self._map(), g.slot_off(slot), g.slot_stride, SLOT_RETRIES)
        return None if raw is None else slot.to_bytes(8, "little") + raw[8:]

    def cached_blocks(self) -> tuple[int, int, list[Block]]:
        """(head, epoch, blocks): the head loaded before the scan (replay the ring after it
        on top), the clear epoch, and every block cached in that epoch."""
        head, epoch, data = self.cached_rows()
        stride = self.geometry.slot_stride  # type: ignore[union-attr]
        blocks = [
            # kv_table_scan puts the slot's number where its seq was
            self._decode(int.from_bytes(data[off : off + 8], "little"), data[off : off + stride])
            for off in range(0, len(data), stride)
        ]
        return head, epoch, blocks

    def cached_rows(self) -> tuple[int, int, bytes]:
        """`cached_blocks` undecoded: (head, epoch, the cached slots' copies, slot_stride
        bytes each in slot order, the first 8 bytes of each its slot's number)."""
        head, epoch, chunks = self.cached_row_chunks()
        return head, epoch, b"".join(data for _start, _end, data in chunks)

    def cached_row_chunks(
        self, chunk: int = SCAN_CHUNK
    ) -> tuple[int, int, Iterator[tuple[int, int, bytes]]]:
        """`cached_rows` a chunk at a time (one C scan of at most ``chunk`` copies each):
        (head, epoch, chunks), each chunk (first slot, end slot, the cached slots' copies
        among [first, end)); head and epoch are loaded before the first scan."""
        mm = self._map()
        g = self.geometry
        assert g is not None
        head = self.head()  # first: a clear after it is in the ring after it
        epoch = self.epoch()

        def chunks() -> Iterator[tuple[int, int, bytes]]:
            slot = 0
            while slot < g.n_slots:
                start = slot
                slot, data = _seqlock.kv_table_scan(
                    mm,
                    g.table_off,
                    g.slot_stride,
                    g.n_slots,
                    epoch & 0xFFFFFFFF,
                    start,
                    chunk,
                    8,
                )
                yield start, slot, data

        return head, epoch, chunks()

    def lora_name(self, index: int) -> str | None:
        """The name table's entry ``index`` (cached: written once, before first use)."""
        if index in self._names:
            return self._names[index]
        g = self.geometry
        name = None
        if g is not None and 0 < index < g.names_count:
            raw = _seqlock.kv_slot_read(self._map(), g.name_off(index), kvl.NAME_ENTRY, 64)
            if raw is not None:
                n = int.from_bytes(raw[8:10], "little")
                if n <= kvl.NAME_MAX_BYTES:
                    name = raw[10 : 10 + n].decode(errors="replace")
                    self._names[index] = name
        return name

    # -- liveness ---------------------------------------------------------------------

    def writer_alive(self) -> bool:
        if self.fd < 0:
            return False
        try:
            return liveness.write_locked(self.fd)
        except OSError:
            return False

    # -- helpers -------------------------------------------------------------------

    def _map(self) -> mmap.mmap:
        if self.mm is None:
            raise ReadError(f"{self.name}: not attached")
        return self.mm

    def _decode(self, slot: int, raw: bytes) -> Block:
        (
            _seq,
            version,
            block_hash,
            parent,
            epoch,
            flags,
            medium,
            group_idx,
            n_tokens,
            name_idx,
            spec_idx,
            _reserved,
            lora_id,
        ) = kvl.SLOT_HEAD.unpack_from(raw, 0)
        g = self.geometry
        assert g is not None
        n = min(n_tokens, g.block_size)
        tokens = tuple(memoryview(raw)[kvl.SLOT_FIXED : kvl.SLOT_FIXED + 4 * n].cast("I"))
        return Block(
            slot,
            version,
            block_hash,
            parent if flags & kvl.FLAG_HAS_PARENT else None,
            bool(flags & kvl.FLAG_CACHED),
            epoch,
            kvl.MEDIA.get(medium),
            group_idx,
            tokens,
            lora_id if flags & kvl.FLAG_HAS_LORA_ID else None,
            name_idx,
            spec_idx,
        )


def check_header(header: kvl.Header, file_size: int, path: str) -> ReadError | None:
    """The header's checks (segment-format.md, "KV-event segment"), in order."""
    if header.magic == b"\0" * 8:
        return NotReady(f"{path} is still being created")
    if header.magic != kvl.MAGIC:
        return Corrupt(f"{path}: bad magic {header.magic!r}: not a KV-event segment")
    if header.major != kvl.LAYOUT_MAJOR:
        return VersionMismatch(
            f"{path}: KV-event layout {header.major}.{header.minor}, this reader knows "
            f"{kvl.LAYOUT_MAJOR}.x: upgrade kvsidecar"
        )
    if header.header_len != kvl.HEADER_LEN or header.record_size != kvl.RECORD_SIZE:
        return Corrupt(f"{path}: header_len {header.header_len} / record_size {header.record_size}")
    if header.total_size != file_size:
        return Corrupt(f"{path}: total_size {header.total_size} != file size {file_size}")
    wrong = kvl.geometry_error(
        header.n_slots, header.block_size, header.ring_cap, header.names_count, file_size
    )
    if wrong is not None:
        return Corrupt(f"{path}: {wrong}")
    g = header.geometry()
    placed = (header.slot_stride, header.ring_off, header.table_off, header.names_off)
    if placed != (g.slot_stride, g.ring_off, g.table_off, g.names_off):
        return Corrupt(f"{path}: offsets {placed} are not where the geometry puts them")
    return None
