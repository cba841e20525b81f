"""docs/segment-format.md's minimal independent reader works on a real segment."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import signal
import struct
import zlib
from collections.abc import Iterator

import msgspec
import pytest

from kvsidecar.protocol.names import DEFAULT_SHM_DIR
from kvsidecar.protocol.writer import SegmentWriter
from tests.conftest import REPO
from tests.support.protocol_helpers import sample_snapshot


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


# --- a reader written from the document agrees with ours (issue #13, item 9) ------------

from kvsidecar.protocol import reader as ours  # noqa: E402
from kvsidecar.protocol.schema import to_dict  # noqa: E402
from tests.support.writers import fork_writer, stop  # noqa: E402

from . import doc_reader  # noqa: E402


def _ours(name: str, shm_dir: str, retries: int = ours.DEFAULT_RETRIES) -> tuple[str, object]:
    r = ours.SegmentReader(name, shm_dir=shm_dir, retries=retries)
    try:
        err = r.attach()
        if err is not None:
            return err.kind, None
        got = r.read()
        return ("ok", got) if isinstance(got, ours.Reading) else (got.kind, None)
    finally:
        r.close()


@contextlib.contextmanager
def _settled(writer: int | None) -> Iterator[None]:
    """Hold a writer process still (SIGSTOP, then wait until it is stopped) while both
    readers read: two reads of a writer that steps compare two snapshots (issue 41 item 9:
    `step` 100 against 101). A publish stopped halfway is no matter: published_seq still
    names the last whole slot, which both read."""
    if writer is None:
        yield
        return
    os.kill(writer, signal.SIGSTOP)
    try:
        _, status = os.waitpid(writer, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        yield
    finally:
        os.kill(writer, signal.SIGCONT)


def _agree(
    name: str, shm_dir: str, retries: int = doc_reader.RETRIES, writer: int | None = None
) -> str:
    """Both readers on the same segment: same verdict, same values. The verdict. A writer
    process that may be publishing is named (`writer`): it is held still meanwhile."""
    with _settled(writer):
        kind, reading = _ours(name, shm_dir, retries)
        doc = doc_reader.read(os.path.join(shm_dir, name), retries)
    assert doc.kind == kind, f"document says {doc.kind}, our reader {kind}"
    if reading is not None:
        snap = to_dict(reading.snapshot)
        assert {k: snap["runtime"][k] for k in doc.runtime} == doc.runtime
        assert [{k: p[k] for k in d} for p, d in zip(snap["pools"], doc.pools)] == doc.pools
        assert (doc.seq, doc.generation, doc.incarnation) == (
            reading.seq,
            reading.generation,
            reading.incarnation,
        )
    return kind


def _patch(path: str, off: int, data: bytes) -> None:
    """Overwrite bytes of a live segment behind the writer's back (a corruption)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _slot_base(path: str) -> int:
    with open(path, "rb") as f:
        raw = f.read(256)
    (seq,) = struct.unpack_from("<Q", raw, 64)
    slot_off, stride = struct.unpack_from("<II", raw, 192)
    return slot_off + (seq & 1) * stride


def test_doc_reader_agrees_on_good_and_unpublished(shm_dir: str) -> None:
    with SegmentWriter("kvsidecar.doc.a", shm_dir=shm_dir) as w:
        assert _agree(w.name, shm_dir) == "not_ready"
        for k in range(1, 5):
            w.publish(sample_snapshot(40 + k))
            assert _agree(w.name, shm_dir) == "ok"
        # No retries at all: neither reader has a verdict but "try again".
        assert _agree(w.name, shm_dir, retries=0) == "contended"


@pytest.mark.parametrize(
    "corruption",
    ["payload_crc", "payload_len_over_capacity", "slot_seq", "directory_crc", "total_size"],
)
def test_doc_reader_agrees_on_corrupt_segments(shm_dir: str, corruption: str) -> None:
    """Persistent corruption under a live writer is Corrupt for both, not Contended."""
    with SegmentWriter("kvsidecar.doc.c", shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(7))
        base = _slot_base(w.path)
        if corruption == "payload_crc":
            _patch(w.path, base + 12, b"\xde\xad\xbe\xef")
        elif corruption == "payload_len_over_capacity":
            _patch(w.path, base + 8, struct.pack("<I", 1 << 30))
        elif corruption == "slot_seq":
            _patch(w.path, base, struct.pack("<Q", 12345))
        elif corruption == "directory_crc":
            _patch(w.path, 204, b"\0\0\0\0")
        else:
            _patch(w.path, 16, struct.pack("<Q", 8192))
        assert _agree(w.name, shm_dir) == "corrupt"


@pytest.mark.parametrize("what", ["layout_major", "schema_major", "zero_magic", "bad_magic"])
def test_doc_reader_agrees_on_versions_and_magic(shm_dir: str, what: str) -> None:
    with SegmentWriter("kvsidecar.doc.v", shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(3))
        if what == "layout_major":
            _patch(w.path, 8, struct.pack("<H", 2))
            want = "version_mismatch"
        elif what == "schema_major":
            with open(w.path, "rb") as f:
                raw = f.read(4096)
            dir_off, dir_len = struct.unpack_from("<II", raw, 56)
            directory = bytearray(raw[dir_off : dir_off + dir_len])
            key = b"\xacschema_major"  # msgpack fixstr of 12 bytes, then the value
            at = directory.index(key) + len(key)
            assert directory[at] == 1
            directory[at] = 2
            _patch(w.path, dir_off, bytes(directory))
            _patch(w.path, 204, struct.pack("<I", zlib.crc32(bytes(directory))))
            want = "version_mismatch"
        elif what == "zero_magic":
            _patch(w.path, 0, b"\0" * 8)
            want = "not_ready"
        else:
            _patch(w.path, 0, b"NOTASEG!")
            want = "corrupt"
        assert _agree(w.name, shm_dir) == want


def test_doc_reader_agrees_across_restarts(shm_dir: str) -> None:
    """Generation: +1 only over a dead writer's file; 1 again after a clean close."""
    name = "kvsidecar.doc.r"
    pid = fork_writer(name, shm_dir)
    assert _agree(name, shm_dir, writer=pid) == "ok"
    first = doc_reader.read(os.path.join(shm_dir, name))
    assert first.generation == 1
    stop(pid)  # SIGKILL: the file stays, nobody holds the lock
    assert _agree(name, shm_dir) == "ok"  # the last snapshot is still readable
    pid = fork_writer(name, shm_dir, steps_from=100)
    second = doc_reader.read(os.path.join(shm_dir, name))
    assert _agree(name, shm_dir, writer=pid) == "ok"
    assert second.generation == 2 and second.incarnation != first.incarnation
    stop(pid, signal.SIGTERM)  # clean close: CLOSED, then unlinked
    assert not os.path.exists(os.path.join(shm_dir, name))
    assert doc_reader.read(os.path.join(shm_dir, name)).kind == "not_found"
    pid = fork_writer(name, shm_dir, steps_from=200)
    try:
        third = doc_reader.read(os.path.join(shm_dir, name))
        assert _agree(name, shm_dir, writer=pid) == "ok"
        assert third.generation == 1 and third.incarnation not in (
            first.incarnation,
            second.incarnation,
        )
        assert third.state == 1  # READY from creation on
    finally:
        stop(pid)


def test_doc_reader_agrees_with_a_writer_stepping_fast(shm_dir: str) -> None:
    """Issue 41 item 9: a writer publishing as fast as it can, compared 200 times. Read
    while it stepped, the two readers gave `step` 100 and 101 (a CI failure; 37 of 500
    comparisons here); held still, every comparison is of one snapshot."""
    name = "kvsidecar.doc.fast"
    pid = fork_writer(name, shm_dir, period=0.0)
    try:
        for _ in range(200):
            assert _agree(name, shm_dir, writer=pid) == "ok"
    finally:
        stop(pid)


def test_documented_example_reader_runs(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example reader in the document, run as printed on a live segment."""
    import io
    import sys
    import types
    from contextlib import redirect_stdout

    doc = open(os.path.join(REPO, "docs", "segment-format.md")).read()
    code = re.search(r"minimal independent reader.*?```python\n(.*?)```", doc, re.S).group(1)
    assert "O_NONBLOCK" in code and "schema_major" in code and "dir_crc" in code
    fake = types.ModuleType("msgpack")  # "any msgpack library": msgspec's, here
    fake.unpackb = msgspec.msgpack.decode
    monkeypatch.setitem(sys.modules, "msgpack", fake)
    with SegmentWriter("kvsidecar.vllm.dp0.tp0.pp0", shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(77))
        out = io.StringIO()
        with redirect_stdout(out):
            exec(code.replace(DEFAULT_SHM_DIR + "/", shm_dir + "/"), {})
    assert "'step': 77" in out.getvalue(), out.getvalue()


def test_document_states_what_the_code_does() -> None:
    doc = open(os.path.join(REPO, "docs", "segment-format.md")).read()
    schema = open(os.path.join(REPO, "docs", "schema.md")).read()
    assert "kvsidecar.<engine>[.<role>].dp<d>.tp<t>.pp<p>" in doc
    assert "accepts any minor >= its own" not in doc
    assert re.search(r"^\s+72\s+56 reserved", doc, re.M)
    assert "give up: Contended (transient" not in doc and "-> Corrupt" in doc
    assert "`generation + 1`. Readers" not in doc
    assert "heartbeat_interval" in doc
    assert "kvsidecar-demo" not in schema and "`demo`" in schema
    assert "null block" in schema.split("| mapped_bytes", 1)[1].split("\n", 1)[0]
    from kvsidecar.protocol import layout
    from kvsidecar.protocol.schema import SCHEMA_MAJOR, SCHEMA_MINOR, current_capabilities

    title = doc.splitlines()[0]
    assert f"layout v{layout.LAYOUT_MAJOR}.{layout.LAYOUT_MINOR}" in title
    assert f"schema v{SCHEMA_MAJOR}.{SCHEMA_MINOR}" in title
    assert f'"schema_version": "{current_capabilities().schema_version}"' in doc
    assert f'"schema_minor": {SCHEMA_MINOR}' in doc


def test_documents_state_each_rule_of_the_contract() -> None:
    """Issue #22: every rule a second reader or writer needs is written down, once, where
    it is looked for (the code that enforces each is judged by test_contract_corpus.py,
    test_contract.py and tests/agent/test_contract_agent.py)."""
    doc = open(os.path.join(REPO, "docs", "segment-format.md")).read()
    schema = open(os.path.join(REPO, "docs", "schema.md")).read()
    flat, flat_schema = " ".join(doc.split()), " ".join(schema.split())
    # Wrong statements gone: not "all of these are Corrupt" (zero magic is NotReady,
    # another layout major is VersionMismatch).
    assert "all of these are `Corrupt` errors" not in flat
    assert "all zero is `NotReady`" in flat and "another major is `VersionMismatch`" in flat
    assert "never creates one over 16 MiB" in flat
    assert "a numeric gid written as digits" in flat
    # Gaps filled.
    for rule in (
        "The **whole** name matches",  # the pattern is anchored
        "Only a missing *default* directory means",
        "every *successful* publish also writes",  # the heartbeat
        "is not the number of `step()` calls",
        "exactly **one** msgpack array",
        "`dir_len` is at most **64 KiB**",
        "Required keys (else `Corrupt`)",
        "**Names keep their positions.**",
        "**A refused file.**",
        "`--max-label-length` | 256 bytes of UTF-8",
        "`--max-pools-per-rank` | 64",
        "`--max-series-per-target` | 4,096",
        "`--max-payload-bytes` | 1 MiB",
        "whether or not the file is still there",  # closed = the state byte
        "every publish fails",
        "**on by default**, every 1 s",
    ):
        assert " ".join(rule.split()) in flat, rule
    for rule in (
        "## Values",
        "Every number is in **[0, 2^63)**",
        "**Identity fields**",
        "is **rejected**: it reads as null",
        'One exception to "null = unsupported"',
        "The two ratios are **not** one number",
        "Names from kvcached #385 (v1.4 decision)",
        "## Fields per source (v1.4)",
        "count only requests holding a block",
    ):
        assert " ".join(rule.split()) in flat_schema, rule
    assert "only when every lookup is of whole blocks" not in flat_schema
    # The per-source table has a column for each source, ATOM's included.
    header = next(ln for ln in schema.splitlines() if ln.startswith("| field | our pool"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "field", "our pool", "vLLM", "SGLang", "kvcached", "ATOM"
    ]  # fmt: skip


def _flat(doc: str) -> str:
    with open(os.path.join(REPO, "docs", doc)) as f:
        return " ".join(f.read().split())


def test_documents_state_the_round_4_rules() -> None:
    """Issue 30 items 4-7 and 8a: each rule written where it is looked for; the corpus
    (test_contract_corpus.py) runs the doc reader that follows them against ours."""
    doc, schema = _flat("segment-format.md"), _flat("schema.md")
    for wrong in (
        "may require an owner uid",  # the CLI and daemon default trusts only their own uid
        "fill elements an old writer did not send with nil / default",
        "`unreadable` = the reader said `refused` or `version_mismatch`",
    ):
        assert wrong not in doc, wrong
    for rule in (
        "trust only files owned by **their own uid**",
        "**Each name appears at most once** in a list",
        "when present a map of str to bool: anything else (an array, a value that is not a "
        "bool) is `Corrupt`",
        "The slot's bytes after it (up to `slot_stride`) are not part of it",
        "read elements an old writer did not send as nil, never as a default",
    ):
        assert rule in doc, rule
    assert "calls whose pool source raised or whose arguments were refused do not" not in schema
    for rule in (
        "Every number is in **[0, 2^63)**, a float too",
        "**A record that ends early**",
        "summed **per request**: a block that several ended deferrals shared counts once for each",
    ):
        assert rule in schema, rule


def test_short_record_rule_names_the_identity_fields_it_needs() -> None:
    """schema.md: "a runtime record needs its first 14 elements (through `pp_size`), a pool
    record its first 3 (through `group_id`)": the last non-null identity field of each
    table, as the doc reader and ours apply it (test_contract_corpus.py's short cases)."""
    schema = _flat("schema.md")
    records = (("RuntimeSnapshot", "a runtime record"), ("KVCachePoolSnapshot", "a pool record"))
    for record, what in records:
        table = doc_reader.TABLES[record]
        last = max(
            i for i, (n, kind) in enumerate(table) if n in doc_reader.IDENTITY or kind == "str"
        )
        want = f"{what} needs its first {last + 1} elements (through `{table[last][0]}`)"
        assert want in schema, want


def test_label_budget_lists_every_string_field() -> None:
    """Section 8's --max-label-length row names every str field the daemon checks
    (budget.label_values: every string of the snapshot); `instance` was missing."""
    import typing

    from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot

    row = next(
        ln for ln in _flat("segment-format.md").split("| ") if ln.startswith("every string of")
    )
    listed = set(re.findall(r"`([a-z_]+)`", row))
    strings = {
        f
        for rec in (RuntimeSnapshot, KVCachePoolSnapshot)
        for f, t in typing.get_type_hints(rec).items()
        if t in (str, str | None)
    }
    assert listed == strings, (sorted(listed - strings), sorted(strings - listed))


def test_owner_default_is_the_documented_one() -> None:
    from kvsidecar.cli.options import allowed_uids
    from kvsidecar.protocol.reader import SegmentReader

    assert allowed_uids((), False) == frozenset({os.getuid()})
    assert allowed_uids((4242,), False) == frozenset({os.getuid(), 4242})
    assert allowed_uids((4242,), True) is None  # --allow-any-uid
    assert SegmentReader("kvsidecar.x").allowed_uids is None  # the library: any owner
    doc = _flat("segment-format.md")
    assert "`--allow-uid UID` (`KVSIDECAR_ALLOW_UID`) adds an owner" in doc
