"""A plain Python engine's end, read from outside (issue 41, item 1): an uncaught exception
is a fault (FAULTED, file kept) though ``atexit`` still runs the agent's close(); a normal
exit and Ctrl-C (KeyboardInterrupt) are routine stops ("closed cleanly", file removed).
Real engine processes (our KVBlockPool + agent), the one-shot reader."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvsidecar.protocol.reader import Faulted, NotFound, WriterDead, read_segment

NAME = "kvsidecar.plain.dp0.tp0.pp0"
ENGINE = """
import os, signal, sys
from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
pool = KVBlockPool(64, 16, num_layers=1, kv_heads=1, head_dim=4, device="cpu")
agent = KVSidecarAgent("plain", "m", shm_dir=sys.argv[1], segment_name=sys.argv[2],
                       device="cpu", heartbeat_interval=0.05)
agent.register_pool(pool)
pool.allocate_prompt("r", list(range(40)))
agent.step(1, 0)
how = sys.argv[3]
if how == "raise":
    raise RuntimeError("a bug in the engine loop")
if how == "ctrl-c":
    raise KeyboardInterrupt
if how == "thread-raise":  # a thread's exception does not end the engine
    import threading
    t = threading.Thread(target=lambda: 1 / 0); t.start(); t.join()
    agent.step(1, 0)
"""


def _run(shm_dir: str, how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ENGINE, shm_dir, NAME, how],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_uncaught_exception_leaves_the_segment_faulted(shm_dir: str) -> None:
    out = _run(shm_dir, "raise")
    assert out.returncode == 1 and "a bug in the engine loop" in out.stderr, out.stderr
    got = read_segment(NAME, shm_dir=shm_dir)
    assert isinstance(got, Faulted), got  # not "closed cleanly" by the atexit close()
    assert got.last is not None and got.last.snapshot.runtime.requests_running == 1
    assert os.path.exists(os.path.join(shm_dir, NAME))
    assert "marked FAULTED" in out.stderr and "RuntimeError" in out.stderr


@pytest.mark.parametrize("how", ["exit", "ctrl-c", "thread-raise"])
def test_routine_ends_close_cleanly(shm_dir: str, how: str) -> None:
    out = _run(shm_dir, how)
    # Python ends an uncaught KeyboardInterrupt by SIGINT, as a shell expects.
    assert out.returncode == (-2 if how == "ctrl-c" else 0), out.stderr
    assert "FAULTED" not in out.stderr, out.stderr
    got = read_segment(NAME, shm_dir=shm_dir)
    assert isinstance(got, NotFound), got  # closed and unlinked
    assert not isinstance(got, WriterDead)
