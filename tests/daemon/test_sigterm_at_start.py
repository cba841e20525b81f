"""A SIGTERM right after the daemon first answers shuts it down cleanly.

The HTTP server answered before the SIGTERM handler was installed (the first poll of
the targets ran in between), so a SIGTERM sent as soon as /-/healthy said 200 -- what
a test fixture, a supervisor or a quick `kubectl delete` does -- met the default
action: exit -15, no shutdown. CI hit it once (tests/daemon/test_e2e.py teardown).
"""

from __future__ import annotations

import os
import signal

from tests.support.procs import start_daemon


def test_sigterm_after_the_first_answer_exits_cleanly(shm_dir: str) -> None:
    # Own-uid junk makes the first poll slow (each file is opened and refused), which
    # widened the window between answering and handling SIGTERM (20,000 empty files:
    # on the old order, exit codes [-15, -15, -15]).
    for i in range(20000):
        path = os.path.join(shm_dir, f"kvsidecar.junk{i}.dp0.tp0.pp0")
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    codes = []
    for _ in range(3):
        proc, _url = start_daemon(shm_dir)
        proc.send_signal(signal.SIGTERM)
        codes.append(proc.wait(30))
    assert codes == [0, 0, 0], f"exit codes {codes} (-15: killed by the default action)"
