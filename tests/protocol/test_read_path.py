"""The fast read path keeps every check the slower one had (issue #15 item 3)."""

from __future__ import annotations

import os

import pytest

from kvsidecar.protocol import _seqlock, layout
from kvsidecar.protocol.reader import _READ_FIELDS, Reading, SegmentReader
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot

NAME = "kvsidecar.test.readpath"


def test_read_fields_match_layout_header(shm_dir: str) -> None:
    """The one-unpack header fields are layout.Header's, field for field."""
    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(7))
        with SegmentReader(NAME, shm_dir=shm_dir) as reader:
            assert reader.attach() is None
            status, seq, raw, _, _ = _seqlock.read_latest(reader.mm, 8, reader.fd)
            assert status == _seqlock.OK and seq == 1
            h = layout.Header(raw)
            expected = (h.magic, h.major, h.state, h.incarnation, h.generation, h.writer_pid)
            expected += (h.start_wall_ns, h.heartbeat_mono_ns, h.heartbeat_wall_ns)
            expected += (h.publish_errors_total, h.last_publish_error, h.last_publish_error_mono_ns)
            assert _READ_FIELDS.unpack_from(raw) == expected
            r = reader.read()
            assert isinstance(r, Reading) and r.snapshot == sample_snapshot(7)
            assert (r.incarnation, r.generation, r.writer_pid, r.state) == (
                h.incarnation,
                h.generation,
                os.getpid(),
                layout.STATE_READY,
            )
            assert r.heartbeat_mono_ns >= h.heartbeat_mono_ns > 0
            with pytest.raises(AttributeError):
                r.seq = 2  # type: ignore[misc]  # a Reading is immutable


def test_truncation_seen_by_fstat_and_by_the_sigbus_guard(shm_dir: str) -> None:
    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(1))
        with SegmentReader(NAME, shm_dir=shm_dir) as reader:
            assert reader.attach() is None
            os.truncate(w.path, layout.PAGE)
            # With the fd, the C side fstats first and never touches the lost pages.
            assert _seqlock.read_latest(reader.mm, 8, reader.fd)[0] == _seqlock.TRUNCATED
            # Without it (the old two-argument call), the SIGBUS guard still catches it.
            assert _seqlock.read_latest(reader.mm, 8)[0] == _seqlock.SIGBUS
            result = reader.read()
            assert not isinstance(result, Reading) and result.kind == "corrupt"
            assert "truncated" in str(result)


def test_a_dead_descriptor_is_gone_not_a_crash(shm_dir: str) -> None:
    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(1))
        with SegmentReader(NAME, shm_dir=shm_dir) as reader:
            assert reader.attach() is None
            live, dead = reader.fd, os.dup(reader.fd)
            os.close(dead)
            reader.fd = dead
            try:
                result = reader.read()
            finally:
                reader.fd = live
            assert not isinstance(result, Reading) and result.kind == "gone"


def test_read_latest_argument_errors() -> None:
    with pytest.raises(TypeError):
        _seqlock.read_latest()
    with pytest.raises(TypeError):
        _seqlock.read_latest(b"\0" * 4096, 8, -1, 0)
    with pytest.raises(TypeError):
        _seqlock.read_latest(b"\0" * 4096, "8")
    assert _seqlock.read_latest(b"\0" * 100)[0] == _seqlock.BAD_LAYOUT
