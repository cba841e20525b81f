"""The agent's heartbeat thread never holds the engine's objects, and close() ends it.

A daemon thread holding the last reference to the engine's torch tensors may free them while
the interpreter finalizes, and torch then aborts the process ("terminate called without an
active exception", SIGABRT) after a clean stop: CI saw the demo's P/D engines die so.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
from tests.conftest import REPO


def _heartbeat_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvsidecar-heartbeat"}


def test_the_heartbeat_thread_never_keeps_the_engine_alive(shm_dir: str) -> None:
    before = _heartbeat_threads()
    pool = KVBlockPool(64, 16, num_layers=2, kv_heads=2, head_dim=8, device="cpu")
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0.01)
    agent.register_pool(pool)
    agent.step()
    (thread,) = _heartbeat_threads() - before
    beat, writer = getattr(agent, "_heartbeat", None), agent._writer
    dropped = [weakref.ref(agent), weakref.ref(pool)]
    del agent, pool
    gc.collect()
    try:
        assert thread.is_alive()
        assert [r() for r in dropped] == [None, None], "the heartbeat thread holds the engine"
    finally:
        if beat is not None:
            beat.stop()
        writer.close()


def test_close_ends_the_heartbeat_thread_before_it_returns(shm_dir: str) -> None:
    before = _heartbeat_threads()
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0.01)
    agent.step()
    (thread,) = _heartbeat_threads() - before
    agent.close()
    assert not thread.is_alive()


@pytest.mark.timeout(180)
def test_engines_that_close_and_exit_at_once_exit_cleanly(shm_dir: str) -> None:
    """Eight real engine processes at once (the abort needed load: 5 of 40 on the old agent)."""
    dirs = [os.path.join(shm_dir, str(i)) for i in range(8)]
    procs = []
    for d in dirs:
        os.mkdir(d)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.agent.exiting_engine", d],
                cwd=REPO,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = [(p.wait(150), p.stderr.read()) for p in procs]
    assert [rc for rc, _ in results] == [0] * len(procs), [err for _, err in results]
    assert all(os.listdir(d) == [] for d in dirs)  # and each closed its segment
