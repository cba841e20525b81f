"""Shared fixtures: every test gets its own shm directory (a tmpfs dir under /dev/shm)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def shm_dir() -> Iterator[str]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="kvsidecar-test-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
