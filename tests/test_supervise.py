"""kvsidecar.supervise: a process whose parent is SIGKILLed gets its signal (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO

# middle: starts a child that arms the parent-death signal, prints its pid, then waits.
MIDDLE = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
child.wait()
"""
CHILD = r"""
import os, signal, time
from kvsidecar.supervise import parent_death_signal
parent_death_signal(signal.SIGTERM)(os.getppid())
print("armed", flush=True)  # the same stdout as the middle process (inherited)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_child_dies_when_its_parent_is_killed() -> None:
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, CHILD], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    child = int(middle.stdout.readline())
    assert middle.stdout.readline().strip() == "armed"
    assert _alive(child)
    os.kill(middle.pid, signal.SIGKILL)
    middle.wait()
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the orphan kept running"
