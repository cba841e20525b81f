"""Forked writer processes: cheap enough to start hundreds of times in a test."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from kvsidecar.protocol import layout
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot


def _fork(main: Callable[[Callable[[], None]], None], what: str) -> int:
    """Fork a child running main(ready); return its pid once it called ready()."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        code = 0
        try:
            main(lambda: os.write(wfd, b"r") and None)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    ok = os.read(rfd, 1) == b"r"
    os.close(rfd)
    if not ok:
        os.waitpid(pid, 0)
        raise RuntimeError(f"forked {what} failed to start")
    return pid


def _stop_cleanly_on_sigterm(w: SegmentWriter) -> None:
    # A clean stop closes the writer: CLOSED, then the name is unlinked.
    signal.signal(signal.SIGTERM, lambda *_: (w.close(), os._exit(0)))


def fork_writer(
    name: str, shm_dir: str, period: float = 0.005, steps_from: int = 1, uid: int | None = None
) -> int:
    """Fork a child publishing sample snapshots (step counting up from steps_from); its pid.
    With uid (needs root), the child drops to that uid and gid before creating the segment."""

    def main(ready: Callable[[], None]) -> None:
        if uid is not None:
            os.setgid(uid)
            os.setuid(uid)
        w = SegmentWriter(name, shm_dir=shm_dir)
        _stop_cleanly_on_sigterm(w)
        step = steps_from
        w.publish(sample_snapshot(step))
        ready()
        while True:
            step += 1
            w.publish(sample_snapshot(step))
            time.sleep(period)

    return _fork(main, "writer")


def fork_raw_writer(
    name: str, shm_dir: str, payload: bytes, slot_capacity: int = layout.DEFAULT_SLOT_CAPACITY
) -> int:
    """Fork a child that publishes exactly `payload` (CRC-correct, whatever it decodes to)
    and keeps its heartbeat fresh: a hostile or buggy writer. Returns its pid."""

    def main(ready: Callable[[], None]) -> None:
        w = SegmentWriter(name, shm_dir=shm_dir, slot_capacity=slot_capacity)
        _stop_cleanly_on_sigterm(w)
        w.publish_bytes(payload)
        ready()
        while True:
            time.sleep(0.05)
            w.heartbeat()

    return _fork(main, "raw writer")


def stop(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
