"""What ``/-/ready`` (answered to anyone, outside auth) may say and cost (issue 43, item 5):
counts by state and by refusal reason, never a segment's name; worked out once per poll
cycle however many probes ask. Before: every target's name and state (12 KB for 256 long
names), and each probe ran the whole check (a stream of them took half a core). Real
segments (one writer each), the daemon's own `Daemon` and `TargetSet`."""

from __future__ import annotations

import os
import signal

from kvsidecar.daemon.app import Daemon
from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot
from tests.support.writers import fork_writer

LONG = "x" * 180


def test_ready_names_no_segment_and_stays_short(shm_dir: str) -> None:
    writers = [SegmentWriter(f"kvsidecar.{LONG}{i:03d}.dp0", shm_dir=shm_dir) for i in range(64)]
    dead = fork_writer(f"kvsidecar.{LONG}dead.dp0", shm_dir)
    os.kill(dead, signal.SIGKILL)
    os.waitpid(dead, 0)
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0))
    try:
        for w in writers:
            w.publish(sample_snapshot(1))
        ts.poll_all()
        ok, reason = Daemon(ts).ready()
        assert ok, reason
        assert reason == "ready: 1 dead, 64 up", reason
        assert LONG not in reason and len(reason.encode()) < 300
    finally:
        ts.stop()
        for w in writers:
            w.close()


def test_a_stream_of_probes_checks_once_per_poll_cycle(shm_dir: str) -> None:
    w = SegmentWriter("kvsidecar.one.dp0", shm_dir=shm_dir)
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0))
    views = ts.views
    calls = 0

    def counted():  # the work of a check: one walk of every target's view
        nonlocal calls
        calls += 1
        return views()

    ts.views = counted  # type: ignore[method-assign]
    try:
        w.publish(sample_snapshot(1))
        ts.poll_all()
        daemon = Daemon(ts)
        answers = {daemon.ready() for _ in range(1000)}
        assert answers == {(True, "ready: 1 up")}
        assert calls == 1, calls
        ts.poll_all()  # a new cycle: checked again, once
        assert daemon.ready() == (True, "ready: 1 up")
        assert calls == 2, calls
        w.close()
        ts.poll_all()
        assert daemon.ready() == (True, "ready: 1 dead")  # the closed writer's target
        assert calls == 3, calls
    finally:
        ts.stop()
