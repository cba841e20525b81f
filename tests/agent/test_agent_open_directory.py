"""The agent warns, once, at segment creation, when its directory is one the daemon
refuses (issue 24 item 5's residue): on 0704fc0 the engine published into a 0777
directory without a word while `kvsidecar serve` refused to read it. Real directories,
real modes; the daemon's own refusal is the oracle, so the two cannot drift apart."""

from __future__ import annotations

import logging
import os

import pytest

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.reader import read_segment


def _agent_lines(caplog: pytest.LogCaptureFixture, directory: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("kvsidecar.agent") and directory in r.getMessage()
    ]


@pytest.mark.parametrize("mode", [0o777, 0o773, 0o1777, 0o750, 0o770])
def test_agent_warns_when_the_daemon_would_refuse_its_directory(
    shm_dir: str, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    directory = os.path.join(shm_dir, "segments")
    os.mkdir(directory)
    os.chmod(directory, mode)  # chmod: the umask does not apply
    caplog.set_level(logging.WARNING, logger="kvsidecar")
    agent = KVSidecarAgent("eng", "m", shm_dir=directory, device="cpu")
    try:
        pool = KVBlockPool(64, 16, num_layers=2, kv_heads=2, head_dim=8, device="cpu")
        agent.register_pool(pool)
        agent.step()
        assert agent.enabled and agent.error is None  # the warning changes nothing else
        assert read_segment(agent.segment_name, shm_dir=directory).snapshot is not None
        targets = TargetSet(Discovery(directory, prefix="kvsidecar.", rediscover_interval=0.0))
        targets.poll_all()
        refused = not targets.targets
        warnings = _agent_lines(caplog, directory)
        if refused:
            assert len(warnings) == 1, warnings
            text = warnings[0]
            assert f"mode {mode:04o}" in text, text
            assert "kvsidecar serve refuses" in text and f"chmod 0750 {directory}" in text
        else:
            assert warnings == [], warnings
        agent.step()  # later steps say nothing more: one warning, at creation
        assert _agent_lines(caplog, directory) == warnings
    finally:
        agent.close()
        os.chmod(directory, 0o700)
