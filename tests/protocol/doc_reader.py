"""A segment reader written from docs/segment-format.md alone (issue #13, item 9).

It imports nothing of kvsidecar: only the standard library and a msgpack decoder, as an
outside reader would. Every rule below cites the section it comes from; where this reader
and `kvsidecar.protocol.reader` disagree on a live segment, either the document or our
reader is wrong (tests/protocol/test_doc_reader.py).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

MAGIC = b"KVSCSEG1"  # section 2, offset 0
LAYOUT_MAJOR = 1  # offset 8: "a reader refuses any other major"
SCHEMA_MAJOR = 1  # section 4: "a reader refuses a different schema_major"
RETRIES = 8  # section 3: "repeat up to N times (kvsidecar: 8)"


@dataclass
class DocResult:
    """kind: ok, not_found, refused, not_ready, corrupt, version_mismatch, contended."""

    kind: str
    runtime: dict[str, Any] = field(default_factory=dict)
    pools: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    generation: int = 0
    incarnation: int = 0
    state: int = 0


def _unpack(data: bytes) -> Any:
    return msgspec.msgpack.decode(data)  # "decode it with any msgpack library"


def read(path: str, retries: int = RETRIES) -> DocResult:
    # Section 1: O_RDONLY|O_NOFOLLOW|O_NONBLOCK, regular files only.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return DocResult("not_found")
    except OSError:
        return DocResult("refused")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return DocResult("refused")
        # Section 1: size 0 is NotReady; below 4096 or above 16 MiB is Corrupt.
        if st.st_size == 0:
            return DocResult("not_ready")
        if st.st_size < 4096 or st.st_size > 16 << 20:
            return DocResult("corrupt")
        # "map with PROT_READ, MAP_SHARED, exactly st_size bytes"
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        return _read_mapped(mm, st.st_size, retries)
    finally:
        mm.close()


def _read_mapped(mm: mmap.mmap, size: int, retries: int) -> DocResult:
    u16 = lambda off: struct.unpack_from("<H", mm, off)[0]  # noqa: E731
    u32 = lambda off: struct.unpack_from("<I", mm, off)[0]  # noqa: E731
    u64 = lambda off: struct.unpack_from("<Q", mm, off)[0]  # noqa: E731
    # Section 2, the validation list, in the order it is written.
    magic = mm[0:8]
    if magic == b"\0" * 8:
        return DocResult("not_ready")  # "all zero = still being created"
    if magic != MAGIC:
        return DocResult("corrupt")
    if u16(8) != LAYOUT_MAJOR:
        return DocResult("version_mismatch")  # the daemon's VersionMismatch
    header_len, n_slots, total = u16(12), mm[15], u64(16)
    dir_off, dir_len = u32(56), u32(60)
    slot_off, stride, cap, dir_crc = u32(192), u32(196), u32(200), u32(204)
    if not 256 <= header_len <= 4096 or total != size or n_slots != 2:
        return DocResult("corrupt")
    if not (header_len <= dir_off and dir_off + dir_len <= total):
        return DocResult("corrupt")
    if slot_off < dir_off + dir_len or stride < 16 + cap or slot_off + 2 * stride > total:
        return DocResult("corrupt")
    directory = mm[dir_off : dir_off + dir_len]
    if zlib.crc32(directory) != dir_crc:
        return DocResult("corrupt")
    try:
        caps = _unpack(directory)
    except msgspec.DecodeError:
        return DocResult("corrupt")
    if not isinstance(caps, dict) or caps.get("schema_major") != SCHEMA_MAJOR:
        return DocResult("version_mismatch")
    head = {"generation": u64(32), "incarnation": u64(24), "state": mm[14]}
    # Section 3: the reader side of the latch; the last attempt decides.
    last = "contended"
    for _ in range(retries):
        s = u64(64)
        if s == 0:
            return DocResult("not_ready", **head)
        base = slot_off + (s & 1) * stride
        slot_seq, n, crc = struct.unpack_from("<QII", mm, base)
        bad = n > cap  # "copy no payload, bad = True"
        payload = b"" if bad else mm[base + 16 : base + 16 + n]
        if u64(64) != s:
            last = "contended"
            continue
        if bad or slot_seq != s or zlib.crc32(payload) != crc:
            last = "corrupt"
            continue
        # Section 5: positional [runtime, pools], zipped with the directory's names.
        try:
            record = _unpack(payload)
            runtime, pools = record[0], record[1]
            names_r, names_p = caps["runtime_fields"], caps["pool_fields"]
            return DocResult(
                "ok",
                runtime=dict(zip(names_r, runtime)),
                pools=[dict(zip(names_p, p)) for p in pools],
                seq=s,
                **head,
            )
        except (msgspec.DecodeError, TypeError, IndexError, KeyError):
            return DocResult("corrupt", **head)
    return DocResult(last, **head)
