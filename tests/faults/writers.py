"""Forked writer processes: cheap enough to start hundreds of times in a test."""

from __future__ import annotations

import os
import signal
import time

from kvsidecar.protocol.writer import SegmentWriter
from tests.protocol_helpers import sample_snapshot


def fork_writer(name: str, shm_dir: str, period: float = 0.005, steps_from: int = 1) -> int:
    """Fork a child publishing sample snapshots (step counting up from steps_from); its pid."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        code = 0
        try:
            w = SegmentWriter(name, shm_dir=shm_dir)
            # A clean stop closes the writer: CLOSED, then the name is unlinked.
            signal.signal(signal.SIGTERM, lambda *_: (w.close(), os._exit(0)))
            step = steps_from
            w.publish(sample_snapshot(step))
            os.write(wfd, b"r")
            while True:
                step += 1
                w.publish(sample_snapshot(step))
                time.sleep(period)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    ok = os.read(rfd, 1) == b"r"
    os.close(rfd)
    if not ok:
        os.waitpid(pid, 0)
        raise RuntimeError("forked writer failed to start")
    return pid


def stop(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
