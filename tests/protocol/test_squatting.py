"""Issue #12 item 4: squatting in a shared shm directory, and liveness-lock hijack by readers.

/dev/shm is world-writable (sticky), so any local user can pre-create a name; and any
reader can open a segment read-only. Neither may disable the engine or fake a live writer.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import struct
import subprocess
import sys

import pytest

from kvsidecar.protocol import names, writer
from kvsidecar.protocol.reader import Reading, SegmentReader, WriterDead, read_segment
from kvsidecar.protocol.writer import SegmentError, SegmentWriter
from tests.conftest import REPO
from tests.support.procs import start_writer, wait_for
from tests.support.protocol_helpers import sample_snapshot

NAME = "kvsidecar.squat.dp0"
OTHER_UID = 54321  # a uid that is not ours (files are chown'ed to it; needs root)
NOBODY = 65534

# Looked up, not imported, so that these tests fail by assertion (not at collection) on a
# checkout without the fix.
SegmentSquattedError = getattr(writer, "SegmentSquattedError", SegmentError)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as others")


def test_default_shm_dir_is_a_private_directory_not_world_writable_dev_shm() -> None:
    assert names.DEFAULT_SHM_DIR != "/dev/shm"
    assert os.path.dirname(names.DEFAULT_SHM_DIR) == "/dev/shm"
    assert getattr(names, "DEFAULT_SHM_DIR_MODE", 0o777) & 0o007 == 0  # others: nothing
    assert writer.DEFAULT_SHM_DIR == names.DEFAULT_SHM_DIR  # one source for both sides


def test_default_dir_is_created_0750_whatever_the_umask(shm_dir: str, monkeypatch) -> None:
    private = os.path.join(shm_dir, "kvsidecar")
    monkeypatch.setattr(writer, "DEFAULT_SHM_DIR", private)
    old = os.umask(0)
    try:
        with SegmentWriter(NAME, shm_dir=private) as w:
            w.publish(sample_snapshot(1))
            st = os.stat(private)
            assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_uid == os.geteuid()
            assert isinstance(read_segment(NAME, shm_dir=private), Reading)
    finally:
        os.umask(old)


@needs_root
def test_squatted_default_dir_is_refused_with_owner_and_fix(shm_dir: str, monkeypatch) -> None:
    private = os.path.join(shm_dir, "kvsidecar")
    os.mkdir(private, 0o777)
    os.chown(private, OTHER_UID, OTHER_UID)  # another user got there first
    monkeypatch.setattr(writer, "DEFAULT_SHM_DIR", private)
    with pytest.raises(SegmentSquattedError) as info:
        SegmentWriter(NAME, shm_dir=private)
    msg = str(info.value)
    assert f"uid {OTHER_UID}" in msg and "KVSIDECAR_SHM_DIR" in msg and "\n" not in msg
    assert os.listdir(private) == []


def test_symlinked_shm_dir_is_refused(shm_dir: str) -> None:
    target = os.path.join(shm_dir, "elsewhere")
    os.mkdir(target)
    link = os.path.join(shm_dir, "link")
    os.symlink(target, link)
    with pytest.raises(SegmentError, match="symlink"):
        SegmentWriter(NAME, shm_dir=link)
    assert os.listdir(target) == []


@needs_root
def test_squatted_name_is_a_one_line_error_naming_owner_and_fix(shm_dir: str) -> None:
    os.chmod(shm_dir, 0o1777)  # like /dev/shm
    squat = os.path.join(shm_dir, NAME)
    with open(squat, "wb") as f:
        f.write(b"x" * 4096)
    os.chown(squat, OTHER_UID, OTHER_UID)
    with pytest.raises(SegmentSquattedError) as info:
        SegmentWriter(NAME, shm_dir=shm_dir)
    msg = str(info.value)
    assert f"uid {OTHER_UID}" in msg and "squatting" in msg and "remove it" in msg
    assert "\n" not in msg and "live writer" not in msg
    assert os.stat(squat).st_uid == OTHER_UID  # not replaced, not touched
    assert [n for n in os.listdir(shm_dir) if n.startswith(".")] == []


_AS_NOBODY = r"""
import os, sys
from kvsidecar.protocol.writer import SegmentWriter, SegmentError
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter may be root-only
try:
    SegmentWriter(sys.argv[1], shm_dir=sys.argv[2])
    print("WON")
except SegmentError as e:
    print("ERR", type(e).__name__, e)
except Exception as e:
    print("RAW", type(e).__name__, e)
"""


@needs_root
def test_unprivileged_engine_gets_the_message_not_a_raw_eperm(shm_dir: str) -> None:
    """The reported case: a non-root engine in a sticky dir whose name a neighbour holds."""
    os.chmod(shm_dir, 0o1777)
    squat = os.path.join(shm_dir, NAME)
    with open(squat, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(squat, 0o644)
    os.chown(squat, OTHER_UID, OTHER_UID)
    out = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, NAME, shm_dir],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    ).stdout.strip()
    assert out.startswith("ERR SegmentSquattedError"), out  # was: RAW PermissionError EPERM
    assert f"uid {OTHER_UID}" in out and "KVSIDECAR_SHM_DIR" in out


def test_read_only_reader_cannot_take_the_liveness_lock(shm_dir: str) -> None:
    from kvsidecar.protocol import liveness

    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        fd = os.open(w.path, os.O_RDONLY)
        try:
            with pytest.raises(OSError) as info:
                liveness.lock_for_life(fd)  # F_OFD_SETLK F_WRLCK needs a writable fd
            assert info.value.errno == 9  # EBADF
            assert liveness.write_locked(fd)  # F_OFD_GETLK from the read-only fd sees it
            # The probe's struct flock: l_type F_WRLCK, whole file, l_pid -1 (an OFD lock).
            got = fcntl.fcntl(
                fd, fcntl.F_OFD_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0)
            )
            assert struct.unpack("hhqqi4x", got) == (fcntl.F_WRLCK, 0, 0, 0, -1)
        finally:
            os.close(fd)


_HIJACKER = r"""
import fcntl, os, struct, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print("opened", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:  # once the writer is dead: hold every lock a read-only descriptor can take
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, 0, 0, 0, 0))
        print("hijacked", flush=True)
        break
    except OSError:
        time.sleep(0.01)
time.sleep(60)
"""


def test_reader_locks_neither_fake_a_live_writer_nor_block_its_restart(shm_dir: str) -> None:
    proc, _ = start_writer(NAME, shm_dir)
    path = os.path.join(shm_dir, NAME)
    hijacker = subprocess.Popen(
        [sys.executable, "-c", _HIJACKER, path], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert hijacker.stdout.readline().startswith("opened")
        reader = SegmentReader(NAME, shm_dir=shm_dir)
        assert reader.attach() is None and reader.writer_alive()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert hijacker.stdout.readline().startswith("hijacked")
        # The hijacker holds flock(LOCK_EX) and an OFD read lock on the dead writer's file.
        assert wait_for(lambda: not reader.writer_alive())
        assert isinstance(read_segment(NAME, shm_dir=shm_dir), WriterDead)
        reader.close()
        with SegmentWriter(NAME, shm_dir=shm_dir) as w:  # the restarted engine is let in
            assert w.generation == 2
            w.publish(sample_snapshot(7))
            assert isinstance(read_segment(NAME, shm_dir=shm_dir), Reading)
    finally:
        hijacker.kill()
        hijacker.wait()
        proc.kill()
        proc.wait()
