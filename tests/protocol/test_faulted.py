"""State FAULTED (layout v1.2, segment-format.md sections 6 and 8): a writer whose engine
hit a fatal error reads dead at once, stays dead through its own close() and a
supervisor's close_for_writers, and never reads "closed cleanly" (issue 41, item 1).
Real forked writers, real locks, the daemon's own TargetSet and the one-shot reader."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import layout
from kvsidecar.protocol.reader import Faulted, WriterDead, read_segment
from kvsidecar.protocol.writer import SegmentWriter, close_for_writers
from tests.protocol import doc_reader
from tests.support.protocol_helpers import sample_snapshot
from tests.support.writers import _fork

NAME = "kvsidecar.faulty.dp0.tp0.pp0"


def _fork_faulting_writer(shm_dir: str, then: str) -> int:
    """A child that publishes, marks its segment FAULTED, then `then`: "hold" (keeps the
    lock, as vLLM's engine core does while it is torn down) or "close" (its own close(),
    as an engine's shutdown after the error does, then holds nothing)."""

    def main(ready: Callable[[], None]) -> None:
        w = SegmentWriter(NAME, shm_dir=shm_dir)
        w.publish(sample_snapshot(3))
        w.mark_faulted()
        if then == "close":
            w.close()
        ready()
        signal.pause()

    return _fork(main, "faulting writer")


def _daemon_view(shm_dir: str):
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=3600.0))
    try:
        ts.poll_all()
        return ts.targets[NAME].view
    finally:
        ts.stop()


def _reap(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)
    os.waitpid(pid, 0)


def test_a_faulted_writer_reads_dead_while_alive_and_after(shm_dir: str) -> None:
    pid = _fork_faulting_writer(shm_dir, "hold")
    try:
        got = read_segment(NAME, shm_dir=shm_dir)
        assert isinstance(got, Faulted) and got.kind == "faulted", got
        assert "fatal error" in str(got) and "torn down" in str(got)
        assert got.last is not None and got.last.snapshot.runtime.step == 3  # last values kept
        view = _daemon_view(shm_dir)
        assert (view.state, view.error_kind) == ("dead", "faulted"), view
        assert "closed cleanly" not in view.error
        # A supervisor stopping it (vLLM's process manager at timeout 0) closes nothing.
        assert close_for_writers(shm_dir, {pid}, dead_only=False) == []
        _reap(pid)
        assert close_for_writers(shm_dir, {pid}, dead_only=True) == []
        got = read_segment(NAME, shm_dir=shm_dir)
        assert isinstance(got, Faulted) and "writer is gone" in str(got), got
        view = _daemon_view(shm_dir)
        assert (view.state, view.error_kind) == ("dead", "faulted"), view
        assert os.path.exists(os.path.join(shm_dir, NAME)), "a faulted segment was removed"
        with open(os.path.join(shm_dir, NAME), "rb") as f:
            assert f.read(16)[layout.OFF_STATE] == layout.STATE_FAULTED
    finally:
        try:
            _reap(pid)
        except ProcessLookupError:
            pass


def test_its_own_close_keeps_it_faulted_and_in_place(shm_dir: str) -> None:
    pid = _fork_faulting_writer(shm_dir, "close")
    try:
        got = read_segment(NAME, shm_dir=shm_dir)
        assert isinstance(got, Faulted) and "writer is gone" in str(got), got
        assert os.path.exists(os.path.join(shm_dir, NAME))
        assert doc_reader.read(os.path.join(shm_dir, NAME)).state == layout.STATE_FAULTED
    finally:
        _reap(pid)


def test_closed_is_never_overwritten_by_a_late_fault(shm_dir: str) -> None:
    """A supervisor closed it for a routine stop; a fault noticed after (vLLM's orphan
    watch as the API server exits) must not turn that stop into a fault."""
    w = SegmentWriter(NAME, shm_dir=shm_dir)
    try:
        w.publish(sample_snapshot(1))
        assert close_for_writers(shm_dir, {os.getpid()}, dead_only=False) == [NAME]
        w.mark_faulted()
        assert not w.faulted
    finally:
        w.close()
    assert not os.path.exists(os.path.join(shm_dir, NAME))


def test_a_plain_dead_writer_is_still_writer_dead(shm_dir: str) -> None:
    """The control: no mark, SIGKILL: writer_dead (not faulted, not closed)."""
    w = SegmentWriter(NAME, shm_dir=shm_dir)
    w.publish(sample_snapshot(1))
    w._forget_in_child()  # releases the lock as a killed process would, file left
    got = read_segment(NAME, shm_dir=shm_dir)
    assert type(got) is WriterDead and "writer is gone" in str(got), got
