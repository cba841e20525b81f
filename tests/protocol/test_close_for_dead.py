"""close_for_writers: a supervisor closes the segments of the children it killed
(issue #23, item 4: vLLM SIGKILLs its engine core right after SIGTERM by default, and the
stop read as a crash). Real processes, real SIGKILL, the daemon's own TargetSet."""

from __future__ import annotations

import os
import signal

from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import close_for_writers
from tests.support.writers import fork_writer


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_killed_writers_read_as_closed_cleanly_and_others_are_untouched(shm_dir: str) -> None:
    killed = fork_writer("kvsidecar.killed.dp0.tp0.pp0", shm_dir)
    other_dead = fork_writer("kvsidecar.crashed.dp0.tp0.pp0", shm_dir)
    live = fork_writer("kvsidecar.live.dp0.tp0.pp0", shm_dir)
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0))
    try:
        ts.poll_all()
        assert {t.view.state for t in ts.targets.values()} == {"up"}
        _kill(killed)
        _kill(other_dead)
        # The live writer's pid is named too: a live lock holder is never closed.
        assert close_for_writers(shm_dir, {killed, live}) == ["kvsidecar.killed.dp0.tp0.pp0"]
        ts.poll_all()
        views = {n: t.view for n, t in ts.targets.items()}
        assert "closed cleanly" in views["kvsidecar.killed.dp0.tp0.pp0"].error
        assert "writer is gone" in views["kvsidecar.crashed.dp0.tp0.pp0"].error  # not ours
        assert views["kvsidecar.live.dp0.tp0.pp0"].state == "up"
        assert sorted(os.listdir(shm_dir)) == [
            "kvsidecar.crashed.dp0.tp0.pp0",
            "kvsidecar.live.dp0.tp0.pp0",
        ]
        assert close_for_writers(shm_dir, set()) == []
        assert close_for_writers(shm_dir + "/missing", {killed}) == []
    finally:
        ts.stop()
        os.kill(live, signal.SIGTERM)
        os.waitpid(live, 0)


def test_a_writer_about_to_be_killed_can_be_closed_first(shm_dir: str) -> None:
    """dead_only=False: closed while its writer still runs (vLLM is about to SIGKILL it)."""
    pid = fork_writer("kvsidecar.stopping.dp0.tp0.pp0", shm_dir)
    other = fork_writer("kvsidecar.other.dp0.tp0.pp0", shm_dir)
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0))
    try:
        ts.poll_all()
        assert close_for_writers(shm_dir, {pid}) == []  # alive: not without dead_only=False
        assert close_for_writers(shm_dir, {pid}, dead_only=False) == [
            "kvsidecar.stopping.dp0.tp0.pp0"
        ]
        _kill(pid)
        ts.poll_all()
        assert "closed cleanly" in ts.targets["kvsidecar.stopping.dp0.tp0.pp0"].view.error
        assert ts.targets["kvsidecar.other.dp0.tp0.pp0"].view.state == "up"
    finally:
        ts.stop()
        os.kill(other, signal.SIGTERM)
        os.waitpid(other, 0)


def test_a_writer_that_already_crashed_is_never_closed_before_the_kill(shm_dir: str) -> None:
    """dead_only=False acts only for a writer still alive: vLLM runs the same pre-kill close
    when it cleans up after a core that crashed, and that crash must read dead (issue 30)."""
    crashed = fork_writer("kvsidecar.crashed.dp0.tp0.pp0", shm_dir)
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0))
    try:
        ts.poll_all()
        _kill(crashed)
        assert close_for_writers(shm_dir, {crashed}, dead_only=False) == []
        ts.poll_all()
        view = ts.targets["kvsidecar.crashed.dp0.tp0.pp0"].view
        assert view.state == "dead" and "writer is gone" in view.error, view
        assert os.listdir(shm_dir) == ["kvsidecar.crashed.dp0.tp0.pp0"]
    finally:
        ts.stop()
