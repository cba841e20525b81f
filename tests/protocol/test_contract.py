"""The contract's rules that are not a reader's verdict on bytes (issue #22): what the
writer refuses to create, and how a live or closed writer is judged."""

from __future__ import annotations

import os
import time

import msgspec
import pytest

from agent import KVSidecarAgent
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import layout, names
from kvsidecar.protocol.reader import Stale, WriterDead, read_segment
from kvsidecar.protocol.schema import Capabilities, KVCachePoolSnapshot, current_capabilities
from kvsidecar.protocol.writer import SegmentError, SegmentWriter
from tests.support.protocol_helpers import sample_snapshot
from tests.support.writers import _fork

NAME = "kvsidecar.contract.dp0"


def test_writer_refuses_a_segment_bigger_than_any_reader_accepts(shm_dir: str) -> None:
    """Section 1: at most 16 MiB. A 9 MiB slot makes two slots > 16 MiB: refused at
    creation, with the fix, and nothing is left in the directory."""
    with pytest.raises(SegmentError, match="smaller slot"):
        SegmentWriter(NAME, shm_dir=shm_dir, slot_capacity=9 << 20)
    assert os.listdir(shm_dir) == []
    # The largest slot that fits is still accepted, and read.
    biggest = (16 << 20) // 2 - 4096
    with SegmentWriter(NAME, shm_dir=shm_dir, slot_capacity=biggest) as w:
        assert w.total_size <= layout.MAX_SEGMENT_SIZE
        w.publish(sample_snapshot(1))
        assert read_segment(NAME, shm_dir=shm_dir).snapshot.runtime.step == 1


def test_writer_refuses_a_directory_readers_would_refuse(shm_dir: str) -> None:
    caps = msgspec.structs.asdict(current_capabilities())
    swapped = list(caps["runtime_fields"])
    swapped[15], swapped[16] = swapped[16], swapped[15]
    reordered = Capabilities(**{**caps, "runtime_fields": swapped})
    with pytest.raises(SegmentError, match="runtime_fields"):
        SegmentWriter(NAME, shm_dir=shm_dir, capabilities=reordered)
    twice = Capabilities(**{**caps, "runtime_fields": [*caps["runtime_fields"], "step"]})
    with pytest.raises(SegmentError, match="lists 'step' twice"):  # issue 30 item 5
        SegmentWriter(NAME, shm_dir=shm_dir, capabilities=twice)
    distinct = (f"x{i:059}" for i in range(1200))
    huge = Capabilities(**{**caps, "pool_fields": [*caps["pool_fields"], *distinct]})
    with pytest.raises(SegmentError, match="directory of"):
        SegmentWriter(NAME, shm_dir=shm_dir, capabilities=huge)
    assert os.listdir(shm_dir) == []


def test_group_takes_a_numeric_gid(shm_dir: str) -> None:
    """operations.md: KVSIDECAR_GROUP is a name or a gid; digits are a gid."""
    gid = os.getgid()
    with SegmentWriter(NAME, shm_dir=shm_dir, group=str(gid)) as w:
        assert os.stat(w.path).st_gid == gid
    env = {"KVSIDECAR_SHM_DIR": shm_dir, "KVSIDECAR_GROUP": str(gid), "KVSIDECAR_SEGMENT": NAME}
    agent = KVSidecarAgent("test", env=env)
    try:
        assert agent.enabled, agent.error
        assert os.stat(agent.segment_path).st_gid == gid
    finally:
        agent.close()


def test_name_pattern_matches_the_whole_name() -> None:
    """Section 1: the pattern applies to the whole name, so a trailing '/x' or newline
    after a valid prefix is refused, and 201 characters is the longest name."""
    ok = "k" * 201
    assert names.validate_name(ok) == ok
    for bad in ("k" * 202, "kvsidecar.a/b", "kvsidecar.a\n", "kvsidecar.a b", "kvsidecar..a"):
        with pytest.raises(names.InvalidName):
            names.validate_name(bad)


class _OutgrowingSource:
    """A pool whose record outgrows the slot once broken: every publish fails whole (a
    pool that merely raises is left out and the rest still published, issue 24)."""

    def __init__(self) -> None:
        self.broken = False

    def snapshot(self) -> KVCachePoolSnapshot:
        integration = "x" * (64 << 10) if self.broken else None  # > the 16 KiB slot
        return KVCachePoolSnapshot(pool_name="grows", total_blocks=8, integration=integration)


def test_an_engine_stepping_with_every_publish_failing_is_not_called_hung(shm_dir: str) -> None:
    """Section 2: last_publish_error_mono_ns newer than the heartbeat = failing right now.
    The heartbeat moves only on successful publishes, so the segment goes stale; the
    verdict must say the publishes fail, not that the engine hung."""
    source = _OutgrowingSource()
    # No idle heartbeat: this test ages the segment on purpose.
    agent = KVSidecarAgent("test", shm_dir=shm_dir, segment_name=NAME, heartbeat_interval=0)
    try:
        assert agent.register_pool(source)
        agent.step()
        targets = TargetSet(Discovery(shm_dir, names=(NAME,)), polling=Polling(stale_after=0.05))
        source.broken = True
        # Sleeping only makes the heartbeat older: a lower bound, safe on a loaded host.
        time.sleep(0.2)
        for _ in range(3):
            agent.step()  # the engine keeps stepping; every publish fails
        targets.poll_all()
        view = targets.targets[NAME].view
        assert view.state == "stale" and view.error_kind == "publish_failing", view
        assert "every publish fails" in view.error and "too_large" in view.error
        assert "hung" not in view.error
        result = read_segment(NAME, shm_dir=shm_dir, stale_after=0.05)
        assert isinstance(result, Stale) and "every publish fails" in str(result)
        targets.stop()
        # Stopped stepping, publishes no longer failing: that is a hung engine.
        source.broken = False
        agent.step()
        time.sleep(0.2)
        result = read_segment(NAME, shm_dir=shm_dir, stale_after=0.05)
        assert isinstance(result, Stale) and "hung" in str(result)
    finally:
        agent.close()


def test_closed_is_the_state_byte_whether_or_not_the_file_was_unlinked(shm_dir: str) -> None:
    """Section 2: CLOSED with the lock free means the writer left cleanly. The daemon and
    read_segment() judge it alike, also when the writer died before its unlink."""

    def main(ready) -> None:
        w = SegmentWriter(NAME, shm_dir=shm_dir)
        w.publish(sample_snapshot(3))
        fd = os.open(w.path, os.O_RDWR)
        os.pwrite(fd, bytes([layout.STATE_CLOSED]), layout.OFF_STATE)
        os.close(fd)
        ready()
        os._exit(0)  # no close(): the file stays, the locks go with the process

    pid = _fork(main, "closing writer")
    os.waitpid(pid, 0)
    assert os.path.exists(os.path.join(shm_dir, NAME))
    targets = TargetSet(Discovery(shm_dir, names=(NAME,)), polling=Polling(stale_after=3600))
    try:
        targets.poll_all()
        view = targets.targets[NAME].view
        assert (view.state, view.error_kind) == ("dead", "closed"), view
        assert view.last is not None and view.last.snapshot.runtime.step == 3
    finally:
        targets.stop()
    result = read_segment(NAME, shm_dir=shm_dir)
    assert isinstance(result, WriterDead) and "closed cleanly" in str(result)
