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


# CI must run what it can run: under CI=true or KVSIDECAR_REQUIRE_ENGINES=1 a skip fails
# the run unless its reason is a limit of the CI host itself (no GPU there, root there).
# A module-level importorskip of an extra that failed to install would otherwise pass.
HOST_LIMITS = ("no CUDA device", "as root")


def _unexpected_skips(reporter) -> list[str]:
    if os.environ.get("CI") != "true" and os.environ.get("KVSIDECAR_REQUIRE_ENGINES") != "1":
        return []
    found = []
    for report in reporter.stats.get("skipped", []) if reporter else []:
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        if not any(limit in reason for limit in HOST_LIMITS):
            found.append(f"{report.nodeid}: {reason}")
    return found


def pytest_sessionfinish(session, exitstatus) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _unexpected_skips(reporter):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    unexpected = _unexpected_skips(terminalreporter)
    if unexpected:
        terminalreporter.section("skips CI must not have (CI=true or KVSIDECAR_REQUIRE_ENGINES=1)")
        for line in unexpected:
            terminalreporter.write_line(line)
