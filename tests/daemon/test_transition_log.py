"""State-change log lines are throttled per target (issue 24 item 5): a flapping writer
logged about 5.7 lines a second on cb621d7. Real writers, real segments."""

from __future__ import annotations

import logging

import pytest

from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot

NAME = "kvsidecar.flap.dp0.tp0.pp0"


def test_a_flapping_writer_logs_a_few_lines_not_one_per_change(
    shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    ts = TargetSet(
        Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=0.0, confirm_after=0.0)
    )
    with caplog.at_level(logging.INFO, logger="kvsidecar.daemon"):
        for step in range(20):  # up, closed, up, closed, ...: 40 state changes
            w = SegmentWriter(NAME, shm_dir=shm_dir)
            w.publish(sample_snapshot(step + 1))
            ts.poll_all()
            w.close()
            ts.poll_all()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{NAME}: ")]
    # A burst of 5, then one per 10 s: the loop takes well under 10 s even when loaded.
    assert 1 <= len(lines) <= 6, lines
