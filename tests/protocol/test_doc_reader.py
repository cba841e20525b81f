"""docs/segment-format.md's minimal independent reader works on a real segment."""

from __future__ import annotations

import mmap
import os
import re
import struct
import zlib

import msgspec

from kvsidecar.protocol.writer import SegmentWriter
from tests.conftest import REPO

from ..protocol_helpers import sample_snapshot


def test_documented_offsets_match_layout() -> None:
    from kvsidecar.protocol import layout

    doc = open(os.path.join(REPO, "docs", "segment-format.md")).read()
    for off, field in [
        (layout.OFF_MAJOR, "layout_major"),
        (layout.OFF_STATE, "state"),
        (layout.OFF_INCARNATION, "incarnation"),
        (layout.OFF_PUBLISHED_SEQ, "published_seq"),
        (layout.OFF_HEARTBEAT_MONO, "heartbeat_mono_ns"),
        (layout.OFF_SLOT_OFF, "slot_off"),
        (layout.OFF_SLOT_CAPACITY, "slot_capacity"),
        (layout.OFF_DIR_CRC, "dir_crc32"),
    ]:
        assert re.search(rf"^\s+{off}\s+\d+\s+{field}\b", doc, re.M), field


def test_independent_reader_from_the_doc(shm_dir: str) -> None:
    with SegmentWriter("kvsidecar.doc.dp0", shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(41))
        w.publish(sample_snapshot(42))
        fd = os.open(w.path, os.O_RDONLY | os.O_NOFOLLOW)
        mm = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
        assert mm[0:8] == b"KVSCSEG1" and struct.unpack_from("<H", mm, 8)[0] == 1
        dir_off, dir_len = struct.unpack_from("<II", mm, 56)
        caps = msgspec.msgpack.decode(mm[dir_off : dir_off + dir_len])
        slot_off, stride, cap = struct.unpack_from("<III", mm, 192)
        s = struct.unpack_from("<Q", mm, 64)[0]
        base = slot_off + (s & 1) * stride
        seq, n, crc = struct.unpack_from("<QII", mm, base)
        payload = mm[base + 16 : base + 16 + min(n, cap)]
        assert seq == s == 2 and zlib.crc32(payload) == crc
        runtime, pools = msgspec.msgpack.decode(payload)[:2]
        named = dict(zip(caps["runtime_fields"], runtime))
        assert named["step"] == 42 and named["engine"] == "test"
        assert dict(zip(caps["pool_fields"], pools[0]))["allocated_blocks"] == 42
        mm.close()
        os.close(fd)
