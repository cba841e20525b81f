"""Fixtures of the daemon tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.procs import start_rank


@pytest.fixture
def rank(shm_dir: str) -> Iterator[None]:
    """One fake engine rank (tests.support.rank_writer) publishing into shm_dir."""
    proc = start_rank("kvsidecar.fake.dp0.tp0.pp0", shm_dir, dp=0, pools=2)[0]
    yield
    proc.kill()
    proc.wait()
