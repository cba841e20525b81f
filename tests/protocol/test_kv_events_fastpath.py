"""The KV-event writer's one-call path (``_seqlock.kv_stored`` / ``kv_removed``) writes the
bytes segment-format.md section 9 describes, i.e. what ``SLOT_BODY`` / ``RECORD`` pack, and a
bad argument raises before anything is written (the recorder then closes the segment)."""

from __future__ import annotations

import mmap
import os

import pytest

from kvsidecar.agent.kv_events import KVEventsRecorder
from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.kv_events_writer import MASK64, KVEventsWriter

BLOCK = 16


def _segment(w: KVEventsWriter) -> bytes:
    with open(w.path, "rb") as f:
        return f.read()


def _slot(raw: bytes, w: KVEventsWriter, slot: int) -> bytes:
    off = w.geometry.table_off + slot * w.geometry.slot_stride
    return raw[off : off + w.geometry.slot_stride]


def _record(raw: bytes, w: KVEventsWriter, n: int) -> bytes:
    off = w.geometry.ring_off + ((n - 1) & (w.geometry.ring_cap - 1)) * kvl.RECORD_SIZE
    return raw[off : off + kvl.RECORD_SIZE]


CASES = [
    # slot, hash, parent, tokens, fields
    (0, 1, None, [], {}),
    (3, MASK64, 2**63 + 5, list(range(BLOCK)), {"first": False, "group_idx": 65535}),
    (7, -1, -2, [0xFFFFFFFF] * 3, {"medium": "CPU", "lora_id": 7, "lora_name": "ad"}),
    (9, 2**70 + 3, 0, [5, 6], {"medium": None, "lora_id": -3, "spec": "sliding_window 128"}),
]


@pytest.mark.parametrize("slot,block_hash,parent,tokens,fields", CASES)
def test_stored_and_removed_bytes_are_the_documented_structs(
    shm_dir: str, slot, block_hash, parent, tokens, fields
) -> None:
    w = KVEventsWriter("fast", n_slots=16, block_size=BLOCK, shm_dir=shm_dir)
    try:
        for _ in range(2):  # the second store over the cached slot: a removal first
            w.stored(slot, block_hash, parent, tokens, **fields)
        head = w.head
        raw = _segment(w)
        flags = kvl.FLAG_CACHED
        flags |= kvl.FLAG_HAS_PARENT if parent is not None else 0
        flags |= kvl.FLAG_HAS_LORA_ID if fields.get("lora_id") is not None else 0
        name_idx = 1 if "lora_name" in fields else 0
        spec_idx = 1 if "spec" in fields else 0
        group = fields.get("group_idx", 0)
        body = kvl.SLOT_BODY.pack(
            2,
            block_hash & MASK64,
            0 if parent is None else parent & MASK64,
            0,
            flags,
            kvl.MEDIUM_CODES[fields.get("medium", "GPU")],
            group,
            len(tokens),
            name_idx,
            spec_idx,
            0,
            fields.get("lora_id") or 0,
        ) + b"".join(t.to_bytes(4, "little") for t in tokens)
        assert _slot(raw, w, slot)[: 8 + len(body)] == (6).to_bytes(8, "little") + body
        first = kvl.REC_FIRST if fields.get("first", True) else 0
        stored = kvl.RECORD.pack(head, kvl.KIND_STORED, first, group, slot, 2, block_hash & MASK64)
        removal = kvl.RECORD.pack(
            head - 1, kvl.KIND_REMOVED, 0, group, slot, 1, block_hash & MASK64
        )
        assert _record(raw, w, head) == stored
        assert _record(raw, w, head - 1) == removal

        cached = _slot(raw, w, slot)
        w.removed(slot, block_hash, group_idx=group)
        raw = _segment(w)
        assert _record(raw, w, head + 1) == kvl.RECORD.pack(
            head + 1, kvl.KIND_REMOVED, 0, group, slot, 2, block_hash & MASK64
        )
        slot_bytes = _slot(raw, w, slot)
        assert slot_bytes[:8] == (8).to_bytes(8, "little")  # even: consistent
        assert slot_bytes[kvl.SLOT_OFF_FLAGS] == flags & ~kvl.FLAG_CACHED
        assert slot_bytes[8 : kvl.SLOT_OFF_FLAGS] == cached[8 : kvl.SLOT_OFF_FLAGS]
        assert slot_bytes[kvl.SLOT_OFF_FLAGS + 1 :] == cached[kvl.SLOT_OFF_FLAGS + 1 :]
    finally:
        w.close()


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, -1],  # a negative token id
        [1, 2**32],  # past u32
        [1, "2"],  # not an int
        list(range(BLOCK + 1)),  # more than block_size
        5,  # not a sequence
    ],
)
def test_a_bad_store_writes_nothing_and_the_recorder_closes(shm_dir: str, tokens) -> None:
    rec = KVEventsRecorder.open("bad", n_slots=8, block_size=BLOCK, shm_dir=shm_dir)
    assert rec is not None
    rec.stored(1, 11, None, [1, 2, 3])
    before = _segment(rec._w)  # type: ignore[arg-type]
    w = rec._w
    with pytest.raises((ValueError, TypeError, OverflowError)):
        w.stored(2, 22, 11, tokens)  # type: ignore[union-attr]
    assert _segment(w) == before  # type: ignore[arg-type]
    rec.stored(2, 22, 11, tokens)  # never raises into the engine: closes instead
    assert not rec.active and rec.error is not None
    assert not os.path.exists(w.path)  # type: ignore[union-attr]


def test_the_c_calls_refuse_offsets_outside_the_segment(shm_dir: str) -> None:
    from kvsidecar.protocol import _seqlock

    mm = mmap.mmap(-1, 4096)
    ring = (1024, 31, kvl.OFF_HEAD)  # 32 records of 32 bytes at 1024
    with pytest.raises(ValueError):
        _seqlock.kv_stored(mm, 4096 - 64, 128, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, [1], *ring, 1)
    with pytest.raises(ValueError):
        _seqlock.kv_stored(mm, 256, 128, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, [1], 4096 - 64, 31,
                           kvl.OFF_HEAD, 1)  # fmt: skip
    with pytest.raises(ValueError):
        _seqlock.kv_removed(mm, 4096, 0, 1, 1, 0, *ring)
    assert mm[:] == bytes(4096)
    assert _seqlock.kv_removed(mm, 256, 0, 1, 1, 0, *ring) == 1
    mm.close()
