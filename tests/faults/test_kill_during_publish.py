"""SIGKILL a writer at random points of publishing, 1,000 times: nothing torn is ever accepted.

Each round forks a child that (re)creates the segment and publishes
pre-encoded snapshots as fast as it can; the parent reads once while it runs,
kills it after a random delay (so the kill lands anywhere inside the latch),
then checks that the reader reports a dead writer and still returns an
intact snapshot at least as new as the one it saw before the kill.
"""

from __future__ import annotations

import os
import random
import signal
import time

from kvsidecar.bench import torn
from kvsidecar.protocol.reader import Reading, SegmentReader, WriterDead, read_segment
from kvsidecar.protocol.schema import encode_snapshot
from kvsidecar.protocol.writer import SegmentWriter

ROUNDS = int(os.environ.get("KVSIDECAR_KILL_ROUNDS", "1000"))
NAME = "kvsidecar.killed.dp0.tp0.pp0"
PAYLOADS = [encode_snapshot(torn.make_snapshot(k)) for k in range(1, 65)]


def _child(shm_dir: str, wfd: int) -> None:
    try:
        w = SegmentWriter(NAME, shm_dir=shm_dir)
        w.publish_bytes(PAYLOADS[0])
        os.write(wfd, b"r")
        i = 0
        while True:
            i += 1
            w.publish_bytes(PAYLOADS[i & 63])
    finally:
        os._exit(1)


def test_sigkill_at_random_points_of_publish(shm_dir: str) -> None:
    rng = random.Random(7)
    dead_seen = 0
    for _ in range(ROUNDS):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(shm_dir, wfd)
        os.close(wfd)
        assert os.read(rfd, 1) == b"r"
        os.close(rfd)
        reader = SegmentReader(NAME, shm_dir=shm_dir)
        assert reader.attach() is None
        before = reader.read()
        time.sleep(rng.random() * 0.002)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert not reader.writer_alive()
        after = reader.read()
        assert isinstance(after, Reading), after
        assert torn.check_snapshot(after.snapshot)  # intact: no field from another publish
        if isinstance(before, Reading):
            assert after.seq >= before.seq and after.incarnation == before.incarnation
        result = read_segment(NAME, shm_dir=shm_dir)
        assert isinstance(result, WriterDead) and result.last is not None
        assert torn.check_snapshot(result.last.snapshot)
        dead_seen += 1
        reader.close()
    assert dead_seen == ROUNDS
    print(f"\nkill-during-publish: {ROUNDS} SIGKILLs, 0 torn accepted, {dead_seen} dead detected")
