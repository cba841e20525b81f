"""The KV-event segment's writer, used by the agent inside the engine process.

Created like the snapshot segment (writer.SegmentFile: exclusive temporary file, mode
0640, preallocated, magic last, OFD liveness lock, install under the name's lock,
generation + 1 over a dead predecessor). Sized once from the number of blocks; every
block stored or removed is one C call (``_seqlock.kv_stored`` / ``kv_removed``: the
slot's fields and the ring record written from their values, the token ids copied from
the list): no encoding, no system call, no lock, no allocation that
grows, and nothing a reader does can make it wait (readers map the file read-only).

Not thread-safe: one engine thread records events (the one that owns the block pool).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from array import array
from collections.abc import Sequence

from kvsidecar.protocol import _seqlock
from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.names import DEFAULT_SHM_DIR
from kvsidecar.protocol.writer import DEFAULT_MODE, SegmentError, SegmentFile

MASK64 = (1 << 64) - 1
_NO_RECORD = b""


class KVEventsWriter(SegmentFile):
    """Owns one KV-event segment. ``slot`` is the engine's block id (0 .. n_slots-1)."""

    MAGIC = kvl.MAGIC

    def __init__(
        self,
        name: str,
        *,
        n_slots: int,
        block_size: int,
        dp_rank: int = 0,
        ring_cap: int = kvl.DEFAULT_RING_CAP,
        names_count: int = kvl.DEFAULT_NAMES,
        shm_dir: str = DEFAULT_SHM_DIR,
        mode: int = DEFAULT_MODE,
        group: str | int | None = None,
    ) -> None:
        super().__init__(name, shm_dir=shm_dir, mode=mode)
        geometry = kvl.Geometry(n_slots, block_size, ring_cap, names_count)
        wrong = kvl.geometry_error(n_slots, block_size, ring_cap, names_count, geometry.total_size)
        if wrong is not None:
            raise SegmentError(f"KV-event segment {name}: {wrong}")
        if not 0 <= dp_rank < 1 << 16:
            raise SegmentError(f"KV-event segment {name}: dp_rank {dp_rank} not in 0..65535")
        self.geometry = geometry
        self.n_slots = n_slots
        self.block_size = block_size
        self.total_size = geometry.total_size
        self.head = 0  # the last record written (only this writer moves it)
        self.epoch = 0
        # Per slot, allocated once (24 bytes): stores so far, the hash it caches and
        # 1 + the epoch it was cached in (0: not cached), so a store over a cached slot
        # first records its removal (readers rely on it: segment-format.md section 9).
        self._versions = array("Q", bytes(8 * n_slots))
        self._hashes = array("Q", bytes(8 * n_slots))
        self._live = array("Q", bytes(8 * n_slots))
        self._rec_buf = bytearray(kvl.RECORD_SIZE)
        self._names: dict[str, int] = {}
        self._commit = _seqlock.kv_commit
        self._stored_c = _seqlock.kv_stored
        self._removed_c = _seqlock.kv_removed
        self._table_off = geometry.table_off
        self._stride = geometry.slot_stride
        self._ring_off = geometry.ring_off
        self._ring_mask = ring_cap - 1

        def fill(mm: mmap.mmap) -> None:
            mm[0 : kvl.HEADER_LEN] = kvl.pack_header(
                magic=b"\0" * 8,
                geometry=geometry,
                incarnation=self.incarnation,
                generation=self.generation,  # final value set under the install lock
                writer_pid=os.getpid() & 0xFFFFFFFF,
                writer_uid=os.getuid() & 0xFFFFFFFF,
                start_wall_ns=time.time_ns(),
                dp_rank=dp_rank,
            )

        self._create(geometry.total_size, group, fill)
        self._after_create()

    # -- hot path ---------------------------------------------------------------

    def stored(
        self,
        slot: int,
        block_hash: int,
        parent_hash: int | None,
        token_ids: Sequence[int],
        *,
        first: bool = True,
        group_idx: int = 0,
        medium: str | None = "GPU",
        lora_id: int | None = None,
        lora_name: str | None = None,
        spec: str | None = None,
    ) -> int:
        """Block ``slot`` now caches ``block_hash``; returns the record's number (0: closed).

        ``first``: this block starts a new BlockStored event (False: it continues the
        previous stored record's event, as vLLM groups one request's new blocks)."""
        mm = self._mm
        if mm is None:
            return 0
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} not in 0..{self.n_slots - 1}")
        n = len(token_ids)
        if n > self.block_size:
            raise ValueError(f"{n} token ids > block_size {self.block_size}")
        if self._live[slot] == self.epoch + 1:
            self.removed(slot, self._hashes[slot], group_idx=group_idx)
        version = self._versions[slot] + 1
        flags = kvl.FLAG_CACHED
        parent = 0
        if parent_hash is not None:
            flags |= kvl.FLAG_HAS_PARENT
            parent = parent_hash & MASK64
        lora = 0
        if lora_id is not None:
            flags |= kvl.FLAG_HAS_LORA_ID
            lora = lora_id
        name_idx = 0 if lora_name is None else self._name_index(lora_name)
        spec_idx = 0 if spec is None else self._name_index(spec)
        block_hash &= MASK64
        self.head = head = self._stored_c(
            mm,
            self._table_off + slot * self._stride,
            self._stride,
            slot,
            version,
            block_hash,
            parent,
            self.epoch & 0xFFFFFFFF,
            flags,
            kvl.MEDIUM_CODES[medium],
            group_idx,
            name_idx,
            spec_idx,
            lora,
            token_ids,
            self._ring_off,
            self._ring_mask,
            kvl.OFF_HEAD,
            kvl.REC_FIRST if first else 0,
        )
        self._versions[slot] = version
        self._hashes[slot] = block_hash
        self._live[slot] = self.epoch + 1
        return head

    def removed(self, slot: int, block_hash: int, *, group_idx: int = 0) -> int:
        """Block ``slot`` no longer caches ``block_hash`` (evicted); returns the record's
        number (0: closed)."""
        mm = self._mm
        if mm is None:
            return 0
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} not in 0..{self.n_slots - 1}")
        self.head = self._removed_c(
            mm,
            self._table_off + slot * self._stride,
            slot,
            self._versions[slot],
            block_hash & MASK64,
            group_idx,
            self._ring_off,
            self._ring_mask,
            kvl.OFF_HEAD,
        )
        self._live[slot] = 0
        return self.head

    def cleared(self) -> int:
        """Every cached block is gone (a prefix-cache reset): O(1), the epoch moves."""
        mm = self._mm
        if mm is None:
            return 0
        self.epoch += 1
        _seqlock.kv_store_u64(mm, kvl.OFF_CLEAR_EPOCH, self.epoch)
        head = self.head + 1
        kvl.RECORD.pack_into(self._rec_buf, 0, head, kvl.KIND_CLEARED, 0, 0, 0, 0, 0)
        self.head = self._commit(
            mm,
            -1,
            _NO_RECORD,
            0,
            self._ring_off + ((head - 1) & self._ring_mask) * kvl.RECORD_SIZE,
            self._rec_buf,
            kvl.OFF_HEAD,
        )
        return self.head

    def _name_index(self, name: str) -> int:
        """The name table's index of a LoRA name, written at its first use; 0 (no name)
        when the table is full or the name too long."""
        index = self._names.get(name)
        if index is not None:
            return index
        raw = name.encode()
        g = self.geometry
        index = len(self._names) + 1
        if len(raw) > kvl.NAME_MAX_BYTES or index >= g.names_count or self._mm is None:
            return 0
        entry = struct.pack("<H", len(raw)) + raw
        self._commit(self._mm, g.name_off(index), entry, 0, -1, _NO_RECORD, 0)
        self._names[name] = index
        return index
