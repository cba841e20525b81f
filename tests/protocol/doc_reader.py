"""A segment reader written from docs/segment-format.md alone (issue #13, item 9).

It imports nothing of kvsidecar: only the standard library and a msgpack decoder, as an
outside reader would. Every rule below cites the section it comes from; where this reader
and `kvsidecar.protocol.reader` disagree on a live segment, either the document or our
reader is wrong (tests/protocol/test_doc_reader.py).
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

MAGIC = b"KVSCSEG1"  # section 2, offset 0
MAX_DIRECTORY = 64 * 1024  # section 4: "at most 64 KiB"
DIRECTORY_KEYS = {  # section 4: the required keys and their types
    "schema_version": str,
    "schema_major": int,
    "schema_minor": int,
    "snapshot_fields": list,
    "runtime_fields": list,
    "pool_fields": list,
}
INT_LIMIT = 2**63  # schema.md "Values": every number in [0, 2^63), finite
IDENTITY = {"pid", "dp_rank", "dp_size", "tp_rank", "tp_size", "pp_rank", "pp_size", "group_id"}
_DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")


def _schema_tables() -> dict[str, list[tuple[str, str]]]:
    """(name, type) of each record's fields in wire order, from schema.md's tables."""
    text = open(os.path.join(_DOCS, "schema.md")).read()
    out: dict[str, list[tuple[str, str]]] = {}
    for record in ("RuntimeSnapshot", "KVCachePoolSnapshot"):
        section = text.split(f"## {record}", 1)[1].split("\n## ", 1)[0]
        rows = []
        for line in section.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 2 and line.startswith("|") and cells[0] not in ("field", "---"):
                rows += [(name.strip(), cells[1]) for name in cells[0].split(",")]
        out[record] = rows
    return out


TABLES = _schema_tables()
RUNTIME_FIELDS = [n for n, _ in TABLES["RuntimeSnapshot"]]
POOL_FIELDS = [n for n, _ in TABLES["KVCachePoolSnapshot"]]
LAYOUT_MAJOR = 1  # offset 8: "a reader refuses any other major"
SCHEMA_MAJOR = 1  # section 4: "a reader refuses a different schema_major"
RETRIES = 8  # section 3: "repeat up to N times (kvsidecar: 8)"


@dataclass
class DocResult:
    """kind: ok, not_found, refused, not_ready, corrupt, version_mismatch, contended,
    faulted."""

    kind: str
    runtime: dict[str, Any] = field(default_factory=dict)
    pools: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    generation: int = 0
    incarnation: int = 0
    state: int = 0
    rejected: list[str] = field(default_factory=list)  # "runtime.<f>" read as None


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
    # Section 4: at most 64 KiB, a map; schema_major first, then the other required keys.
    if dir_len > MAX_DIRECTORY:
        return DocResult("corrupt")
    try:
        caps = _unpack(directory)
    except msgspec.DecodeError:
        return DocResult("corrupt")
    if not isinstance(caps, dict) or not _is_int(caps.get("schema_major")):
        return DocResult("corrupt")
    if caps["schema_major"] != SCHEMA_MAJOR:
        return DocResult("version_mismatch")
    for key, kind in DIRECTORY_KEYS.items():
        if not isinstance(caps.get(key), kind) or isinstance(caps[key], bool):
            return DocResult("corrupt")
    for key in ("snapshot_fields", "runtime_fields", "pool_fields"):  # "arrays of str"
        if not all(isinstance(n, str) for n in caps[key]):
            return DocResult("corrupt")
    features = caps.get("features", {})  # "a map of names to booleans", else Corrupt
    if not isinstance(features, dict) or not all(
        isinstance(k, str) and isinstance(v, bool) for k, v in features.items()
    ):
        return DocResult("corrupt")
    # Section 4: every name this reader knows sits at the position schema.md gives it, and
    # no name is listed twice.
    for names, known in (
        (caps["snapshot_fields"], ["runtime", "pools"]),
        (caps["runtime_fields"], RUNTIME_FIELDS),
        (caps["pool_fields"], POOL_FIELDS),
    ):
        if any(a != b for a, b in zip(names, known)) or len(caps["snapshot_fields"]) < 2:
            return DocResult("corrupt")
        if len(set(names)) != len(names):
            return DocResult("corrupt")
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
        return _decode(payload, caps, s, head)
    return DocResult(last, **head)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _value(v: object, kind: str) -> tuple[bool, object]:
    """schema.md "Values": (ok, value) of one field against its table type."""
    base = kind.rstrip("?")
    if v is None:
        return kind.endswith("?"), None
    if base == "str":
        return isinstance(v, str), v
    if base == "bool":
        return isinstance(v, bool), v
    if base == "int":
        return _is_int(v) and 0 <= v < INT_LIMIT, v
    if base == "float":  # "every number is in [0, 2^63)", a float too
        ok = (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and 0 <= v < INT_LIMIT
        return ok, float(v) if ok else v
    return True, v


def _record(
    values: list, names: list[str], table: list[tuple[str, str]], prefix: str, rejected: list
) -> dict | None:
    """Zip positions with the directory's names; None if an identity value is wrong."""
    kinds = dict(table)
    out: dict[str, Any] = {}
    # schema.md "Values": a field past the record's end reads as null, not counted; an
    # identity field there (one that cannot be null) makes the snapshot Corrupt.
    for name, kind in table[len(values) :]:
        if name in IDENTITY or kind == "str":
            return None
        out[name] = None
    for name, v in zip(names, values):
        ok, v = _value(v, kinds.get(name, ""))
        if not ok:
            if name in IDENTITY or kinds[name].startswith("str"):
                return None  # "makes the snapshot Corrupt"
            rejected.append(prefix + name)
            v = None  # "read as null, counted, the rest served"
        out[name] = v
    return out


def _decode(payload: bytes, caps: dict, s: int, head: dict) -> DocResult:
    # Section 5: exactly one msgpack array [runtime, pools, ...], each record an array.
    try:
        record = _unpack(payload)
    except msgspec.DecodeError:
        return DocResult("corrupt", **head)
    if not isinstance(record, list) or len(record) < 2 or not isinstance(record[1], list):
        return DocResult("corrupt", **head)
    runtime, pools = record[0], record[1]
    if not isinstance(runtime, list) or not all(isinstance(p, list) for p in pools):
        return DocResult("corrupt", **head)
    rejected: list[str] = []
    r = _record(runtime, caps["runtime_fields"], TABLES["RuntimeSnapshot"], "runtime.", rejected)
    ps = [
        _record(p, caps["pool_fields"], TABLES["KVCachePoolSnapshot"], "pool.", rejected)
        for p in pools
    ]
    if r is None or any(p is None for p in ps):
        return DocResult("corrupt", **head)
    # Sections 6 and 8: state 3 FAULTED is dead whatever the lock says (its last values kept).
    kind = "faulted" if head["state"] == 3 else "ok"
    return DocResult(kind, runtime=r, pools=ps, seq=s, rejected=rejected, **head)  # type: ignore[arg-type]
