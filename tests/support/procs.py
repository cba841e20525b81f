"""Real writer processes for lifecycle tests."""

from __future__ import annotations

import subprocess
import sys
import time

from kvsidecar.bench import fleet

WRITER_SCRIPT = r"""
import sys, time
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot
name, shm_dir, period = sys.argv[1], sys.argv[2], float(sys.argv[3])
w = SegmentWriter(name, shm_dir=shm_dir)
step = 1
w.publish(sample_snapshot(step))
print("ready", w.incarnation, flush=True)
while True:
    step += 1
    w.publish(sample_snapshot(step))
    time.sleep(period)
"""


def _start_announcing(args: list[str], what: str) -> tuple[subprocess.Popen, int]:
    """Start `python args...`; once it prints "ready <incarnation>", return it and that."""
    from tests.conftest import REPO

    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"{what} did not start: {line!r}")
    return proc, int(line.split()[1])


def start_writer(name: str, shm_dir: str, period: float = 0.005) -> tuple[subprocess.Popen, int]:
    """Start a publishing writer process; returns it and its incarnation once it published."""
    return _start_announcing(["-c", WRITER_SCRIPT, name, shm_dir, str(period)], "writer")


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.01) -> bool:
    """Poll until ``predicate()`` holds. An "eventually", not a speed claim: a passing test
    returns as soon as it holds, so the 30 s default costs nothing unless the test fails,
    and leaves a loaded host (load average 12 on 2 cores) ample room."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def start_rank(
    name: str, shm_dir: str, dp: int = 0, pools: int = 2, period: float = 0.01
) -> tuple[subprocess.Popen, int]:
    """Start tests.support.rank_writer for one rank; returns it and its incarnation."""
    args = ["-m", "tests.support.rank_writer", name, shm_dir, str(dp), str(pools), str(period)]
    return _start_announcing(args, "rank writer")


def start_daemon(shm_dir: str, *extra: str, **popen) -> tuple[subprocess.Popen, str]:
    """Start `kvsidecar serve` as a real process; returns it and its base URL once healthy."""
    return fleet.start_daemon(shm_dir, *extra, wait_for_source=False, **popen)
