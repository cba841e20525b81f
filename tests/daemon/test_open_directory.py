"""A segment directory any user may write to, without the sticky bit, is refused with the
reason (issue 24 item 5): on cb621d7 a root-owned 0777 directory was accepted, so a
neighbour could delete the live segment (the engine is not told) or replace it."""

from __future__ import annotations

import os

import pytest

from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot


@pytest.mark.parametrize(("mode", "served"), [(0o777, False), (0o1777, True), (0o750, True)])
def test_world_writable_directory_is_refused(shm_dir: str, mode: int, served: bool) -> None:
    os.chmod(shm_dir, mode)
    with SegmentWriter("kvsidecar.eng.dp0.tp0.pp0", shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(2))
        ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=0.0))
        ts.poll_all()
        assert bool(ts.targets) is served
        if not served:
            assert "writable by every user" in ts.discovery_error
            assert f"chmod 0750 {shm_dir}" in ts.discovery_error
            ok, reason = True, ts.discovery_error
            assert ok and "0777" in reason
    os.chmod(shm_dir, 0o700)
