"""Multi-process torn-read stress: 0 torn snapshots accepted, ever."""

from __future__ import annotations

import os

from kvsidecar.bench import torn
from kvsidecar.protocol.schema import Snapshot

SECONDS = float(os.environ.get("KVSIDECAR_STRESS_SECONDS", "5"))


def test_check_snapshot_detects_a_mix() -> None:
    """The oracle itself: a mix of snapshot 100 and 101 is caught without any CRC."""
    a, b = torn.make_snapshot(100), torn.make_snapshot(101)
    assert torn.check_snapshot(a) and torn.check_snapshot(b)
    mixed = Snapshot(runtime=a.runtime, pools=[*a.pools[:2], *b.pools[2:]])
    assert not torn.check_snapshot(mixed)
    pool = b.pools[0]
    pool.allocated_blocks = a.pools[0].allocated_blocks
    assert not torn.check_snapshot(b)


def test_full_speed_writer_two_readers(shm_dir: str) -> None:
    result = torn.run(seconds=SECONDS, readers=2, shm_dir=shm_dir)
    print(f"\nstress: {result}")
    assert result["torn_accepted"] == 0
    assert result["reads"] > 10_000  # the readers really read while the writer ran
    assert result["retries"] > 0  # and the writer really lapped them (the test had teeth)
