"""The KV-event segment's documented contract (docs/segment-format.md, section 9) is what
kv_events_layout.py / the writer / the reader do."""

from __future__ import annotations

import os
import re

import pytest

from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.kv_events_reader import KVEventsReader
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.protocol.reader import Corrupt, VersionMismatch
from tests.conftest import REPO

DOC = open(os.path.join(REPO, "docs", "segment-format.md")).read()
SECTION = DOC.split("## 9. The KV-event segment", 1)[1]


@pytest.mark.parametrize(
    "off, field",
    [
        (kvl.OFF_N_SLOTS, "n_slots"),
        (kvl.OFF_SLOT_STRIDE, "slot_stride"),
        (kvl.OFF_HEAD, "head"),
        (kvl.OFF_CLEAR_EPOCH, "clear_epoch"),
        (kvl.OFF_BLOCK_SIZE, "block_size"),
        (kvl.OFF_RING_CAP, "ring_cap"),
        (kvl.OFF_RING_OFF, "ring_off"),
        (kvl.OFF_TABLE_OFF, "table_off"),
        (kvl.OFF_RECORD_SIZE, "record_size"),
        (kvl.OFF_DP_RANK, "dp_rank"),
        (kvl.OFF_NAMES_OFF, "names_off"),
        (kvl.OFF_NAMES_COUNT, "names_count"),
        (kvl.OFF_STATE, "state"),
        (kvl.OFF_INCARNATION, "incarnation"),
    ],
)
def test_documented_header_offsets(off: int, field: str) -> None:
    assert re.search(rf"^\s+{off}\s+\d+\s+{field}\b", SECTION, re.M), field


def test_documented_slot_and_record_offsets() -> None:
    assert re.search(rf"^\+{kvl.SLOT_OFF_FLAGS}\s+1 flags", SECTION, re.M)
    assert re.search(rf"^\+{kvl.SLOT_FIXED}\s+token_ids", SECTION, re.M)
    assert kvl.RECORD.size == 32 and "A **ring record** (32 bytes" in SECTION
    assert kvl.SLOT_BODY.size == kvl.SLOT_FIXED - 8
    assert kvl.MAGIC.decode() in SECTION


def test_documented_sizes() -> None:
    g = kvl.Geometry(1_000_000, 16, kvl.DEFAULT_RING_CAP, kvl.DEFAULT_NAMES)
    assert f"{g.total_size:,} bytes" in SECTION
    assert g.slot_stride == 56 + 4 * 16


def test_a_store_over_a_cached_slot_records_its_removal(shm_dir: str) -> None:
    with KVEventsWriter("kvevents.x.dp0", n_slots=4, block_size=2, shm_dir=shm_dir) as w:
        w.stored(1, 10, None, [1, 2])
        w.stored(1, 11, None, [3, 4])  # no removal from the caller
        w.cleared()
        w.stored(1, 12, None, [5, 6])  # cleared: nothing to remove
        r = KVEventsReader("kvevents.x.dp0", shm_dir=shm_dir)
        assert r.attach() is None
        kinds = [(x.kind, x.block_hash) for x in r.records(1)]
        r.close()
    S, R, C = kvl.KIND_STORED, kvl.KIND_REMOVED, kvl.KIND_CLEARED
    assert kinds == [(S, 10), (R, 10), (S, 11), (C, 0), (S, 12)]


def test_reader_refuses_what_the_doc_says(shm_dir: str) -> None:
    with KVEventsWriter("kvevents.y.dp0", n_slots=4, block_size=2, shm_dir=shm_dir) as w:
        path = w.path
        with open(path, "r+b") as f:
            f.seek(kvl.OFF_RING_CAP)
            f.write((3).to_bytes(4, "little"))  # not a power of two
        assert isinstance(KVEventsReader(path=path).attach(), Corrupt)
        with open(path, "r+b") as f:
            f.seek(kvl.OFF_RING_CAP)
            f.write(kvl.DEFAULT_RING_CAP.to_bytes(4, "little"))
            f.seek(8)
            f.write((2).to_bytes(2, "little"))
        assert isinstance(KVEventsReader(path=path).attach(), VersionMismatch)
