"""--max-targets cannot be filled by junk ahead of a live engine (issue 24 item 2): on
cb621d7, 256 dead, empty or corrupt segments of the daemon's own uid took every slot and
an engine started later was never served. Real files, a real dead writer process."""

from __future__ import annotations

import os

import msgspec

from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from tests.attacks import hostile_writers as hw
from tests.support.procs import wait_for
from tests.support.protocol_helpers import sample_snapshot


def dead_writer(shm_dir: str, name: str) -> None:
    pid = os.fork()
    if pid == 0:  # publish once, then die without closing: a crashed engine's segment
        try:
            SegmentWriter(name, shm_dir=shm_dir).publish(sample_snapshot(1))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_a_live_engine_displaces_junk_at_the_cap(shm_dir: str) -> None:
    for i in range(3):
        open(os.path.join(shm_dir, f"kvsidecar.empty{i}.dp0.tp0.pp0"), "wb").close()
    with open(os.path.join(shm_dir, "kvsidecar.corrupt.dp0.tp0.pp0"), "wb") as f:
        f.write(os.urandom(8192))
    dead_writer(shm_dir, "kvsidecar.dead.dp0.tp0.pp0")
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=0.0, max_targets=4))
    ts.poll_all()
    junk = set(ts.targets)
    assert len(junk) == 4, junk  # the cap is full of junk (5 junk files)
    with SegmentWriter("kvsidecar.live.dp0.tp0.pp0", shm_dir=shm_dir) as live:
        live.publish(sample_snapshot(2))
        ts.poll_all()
        ts.poll_all()
        assert "kvsidecar.live.dp0.tp0.pp0" in ts.targets, sorted(ts.targets)
        assert ts.targets["kvsidecar.live.dp0.tp0.pp0"].view.state == "up"
        assert len(ts.targets) == 4, "the cap still holds"
        # A second live engine takes another junk slot; junk never displaces a live one.
        with SegmentWriter("kvsidecar.live2.dp0.tp0.pp0", shm_dir=shm_dir) as live2:
            live2.publish(sample_snapshot(3))
            for _ in range(3):
                ts.poll_all()
            assert {"kvsidecar.live.dp0.tp0.pp0", "kvsidecar.live2.dp0.tp0.pp0"} <= set(ts.targets)


def test_segments_up_once_then_dead_yield_their_place(shm_dir: str) -> None:
    """Issue 31 item 8: a crash loop's segments, each up once and then dead (SIGKILL, the
    file left behind), held every slot: on bca725e a new engine was never served."""
    payload = msgspec.msgpack.encode(sample_snapshot(1))
    names = [f"kvsidecar.crash{i}.dp0.tp0.pp0" for i in range(4)]
    pids = [hw.raw_writer(shm_dir, n, payload) for n in names]
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=0.0, max_targets=4))
    try:

        def all_up() -> bool:
            ts.poll_all()
            return all(n in ts.targets and ts.targets[n].view.up for n in names)

        assert wait_for(all_up, timeout=30), ts.views()
        hw._kill(pids)  # dead, files left behind
        ts.poll_all()
        assert all(ts.targets[n].view.state == "dead" for n in names), ts.views()
        with SegmentWriter("kvsidecar.live.dp0.tp0.pp0", shm_dir=shm_dir) as live:
            live.publish(sample_snapshot(2))
            for _ in range(3):
                ts.poll_all()
            assert ts.targets["kvsidecar.live.dp0.tp0.pp0"].view.state == "up", sorted(ts.targets)
            assert len(ts.targets) == 4, "the cap still holds"
            # The dead one displaced stays refused: a dead file never displaces a live one.
            for _ in range(3):
                ts.poll_all()
            assert "kvsidecar.live.dp0.tp0.pp0" in ts.targets
            assert sum(t.view.state == "dead" for t in ts.targets.values()) == 3
    finally:
        hw._kill(pids)
        ts.stop()
