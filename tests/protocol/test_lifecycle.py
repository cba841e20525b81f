"""Writer/reader lifecycle with real processes, signals and filesystems."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

from kvsidecar.protocol import layout
from kvsidecar.protocol.names import InvalidName, validate_name
from kvsidecar.protocol.reader import (
    NotFound,
    Reading,
    Refused,
    SegmentReader,
    VersionMismatch,
    WriterDead,
    read_segment,
)
from kvsidecar.protocol.writer import SegmentBusyError, SegmentError, SegmentWriter, ShmFullError
from tests.support.procs import start_writer, wait_for
from tests.support.protocol_helpers import sample_snapshot

NAME = "kvsidecar.life.dp0"


def test_sigkilled_writer_reports_dead_and_keeps_last_snapshot(shm_dir: str) -> None:
    proc, _ = start_writer(NAME, shm_dir)
    reader = SegmentReader(NAME, shm_dir=shm_dir)
    assert reader.attach() is None
    assert wait_for(lambda: isinstance(r := reader.read(), Reading) and r.snapshot.runtime.step > 5)
    assert reader.writer_alive()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_for(lambda: not reader.writer_alive())
    last = reader.read()
    assert isinstance(last, Reading) and last.snapshot.runtime.step > 5
    assert last.snapshot.pools[0].allocated_blocks == last.snapshot.runtime.step  # intact
    result = read_segment(NAME, shm_dir=shm_dir)
    assert isinstance(result, WriterDead) and result.last is not None
    assert "writer is gone" in str(result)
    reader.close()


def test_restart_is_a_new_incarnation_and_generation(shm_dir: str) -> None:
    proc, inc1 = start_writer(NAME, shm_dir)
    reader = SegmentReader(NAME, shm_dir=shm_dir)
    assert reader.attach() is None
    first = reader.read()
    assert isinstance(first, Reading) and first.incarnation == inc1 and first.generation == 1
    proc.kill()
    proc.wait()
    proc2, inc2 = start_writer(NAME, shm_dir)
    try:
        assert inc2 != inc1
        assert reader.replaced()  # the name points at a new file now
        assert reader.attach() is None
        second = reader.read()
        assert isinstance(second, Reading)
        assert second.incarnation == inc2 and second.generation == 2
        assert reader.writer_alive()
    finally:
        proc2.kill()
        proc2.wait()
        reader.close()


def test_live_writer_name_is_refused(shm_dir: str) -> None:
    with SegmentWriter(NAME, shm_dir=shm_dir):
        with pytest.raises(SegmentBusyError, match="live writer"):
            SegmentWriter(NAME, shm_dir=shm_dir)


def test_clean_close_unlinks_and_marks_closed(shm_dir: str) -> None:
    w = SegmentWriter(NAME, shm_dir=shm_dir)
    w.publish(sample_snapshot(1))
    reader = SegmentReader(NAME, shm_dir=shm_dir)
    assert reader.attach() is None
    w.close()
    assert not os.path.exists(os.path.join(shm_dir, NAME))
    assert reader.replaced() and not reader.writer_alive()
    assert reader.mm is not None and reader.mm[layout.OFF_STATE] == layout.STATE_CLOSED
    reader.close()
    assert isinstance(read_segment(NAME, shm_dir=shm_dir), NotFound)


def test_segment_mode_and_exclusive_temp_create(shm_dir: str) -> None:
    old = os.umask(0o077)  # a strict umask must not narrow the mode, a lax one not widen it
    try:
        with SegmentWriter(NAME, shm_dir=shm_dir) as w:
            st = os.stat(w.path)
            assert stat.S_IMODE(st.st_mode) == 0o640
            assert st.st_size == w.total_size and st.st_size % layout.PAGE == 0
            assert st.st_blocks * 512 >= st.st_size  # preallocated, not sparse
            assert [n for n in os.listdir(shm_dir) if n.endswith(".tmp")] == []
    finally:
        os.umask(old)


def test_symlink_and_fifo_are_refused(shm_dir: str) -> None:
    with SegmentWriter("kvsidecar.real", shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(1))
        os.symlink(w.path, os.path.join(shm_dir, NAME))
        result = read_segment(NAME, shm_dir=shm_dir)
        assert isinstance(result, Refused) and "symlink" in str(result)
        with pytest.raises(SegmentError, match="symlink"):
            SegmentWriter(NAME, shm_dir=shm_dir)
    os.mkfifo(os.path.join(shm_dir, "kvsidecar.fifo"))
    result = read_segment("kvsidecar.fifo", shm_dir=shm_dir)
    assert isinstance(result, Refused) and "not a regular file" in str(result)


def test_foreign_uid_refused_unless_allowed(shm_dir: str) -> None:
    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(1))
        other = frozenset({os.getuid() + 12345})
        result = read_segment(NAME, shm_dir=shm_dir, allowed_uids=other)
        assert isinstance(result, Refused) and "--allow-uid" in str(result)
        ok = read_segment(NAME, shm_dir=shm_dir, allowed_uids=frozenset({os.getuid()}))
        assert isinstance(ok, Reading)


def test_newer_layout_major_refused_minor_accepted(shm_dir: str) -> None:
    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(3))
        with open(w.path, "r+b") as f:  # pretend a newer agent wrote it
            f.seek(layout.OFF_MINOR)
            f.write((layout.LAYOUT_MINOR + 5).to_bytes(2, "little"))
        assert isinstance(read_segment(NAME, shm_dir=shm_dir), Reading)
        with open(w.path, "r+b") as f:
            f.seek(layout.OFF_MAJOR)
            f.write((layout.LAYOUT_MAJOR + 1).to_bytes(2, "little"))
        result = read_segment(NAME, shm_dir=shm_dir)
        assert isinstance(result, VersionMismatch) and "upgrade kvsidecar" in str(result)


def test_names_are_validated(shm_dir: str) -> None:
    for bad in ["../etc/passwd", "a/b", ".hidden", "", "x" * 300, "a..b"]:
        with pytest.raises(InvalidName):
            validate_name(bad)
        with pytest.raises(InvalidName):
            SegmentWriter(bad, shm_dir=shm_dir)
    assert isinstance(read_segment("../x", shm_dir=shm_dir), Refused)


def test_missing_shm_dir_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(SegmentError, match="does not exist"):
        SegmentWriter(NAME, shm_dir=str(tmp_path / "nope"))


def test_full_tmpfs_is_a_clear_error_at_creation() -> None:
    mnt = tempfile.mkdtemp(prefix="kvsidecar-tinyfs-")
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", mnt], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        try:
            with pytest.raises(ShmFullError) as info:
                SegmentWriter(NAME, shm_dir=mnt)
            msg = str(info.value)
            assert "is full" in msg and "bytes" in msg and "\n" not in msg
            assert os.listdir(mnt) == []  # nothing half-made left behind
        finally:
            subprocess.run(["umount", mnt], check=False)
    finally:
        shutil.rmtree(mnt, ignore_errors=True)


def test_fork_child_does_not_keep_writer_alive(shm_dir: str) -> None:
    """A child forked by the engine must not hold the liveness lock or unlink the segment."""
    script = r"""
import os, sys, time
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot
w = SegmentWriter(sys.argv[1], shm_dir=sys.argv[2])
w.publish(sample_snapshot(1))
pid = os.fork()
if pid == 0:
    assert w.publish(sample_snapshot(2)) == 0  # the child never publishes
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
time.sleep(30)
"""
    from tests.conftest import REPO

    proc = subprocess.Popen(
        [sys.executable, "-c", script, NAME, shm_dir], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    child = int(proc.stdout.readline())
    try:
        reader = SegmentReader(NAME, shm_dir=shm_dir)
        assert reader.attach() is None and reader.writer_alive()
        proc.kill()
        proc.wait()
        assert wait_for(lambda: not reader.writer_alive())
        assert os.path.exists(os.path.join(shm_dir, NAME))
        reader.close()
    finally:
        os.kill(child, signal.SIGKILL)


def test_truncated_under_reader_is_corrupt_not_sigbus(shm_dir: str) -> None:
    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(1))
        reader = SegmentReader(NAME, shm_dir=shm_dir)
        assert reader.attach() is None
        os.truncate(w.path, 4096)
        result = reader.read()
        assert not isinstance(result, Reading) and result.kind == "corrupt"
        assert "truncated" in str(result)
        reader.close()
