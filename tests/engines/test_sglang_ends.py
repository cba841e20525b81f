"""Every way a real SGLang 0.5.23 server ends, read as it should (issue 41, item 1): the
checks of tests/engines/ends.py (state, file, series, alert, gateway, over 20 s).

Before: SIGTERM to the whole process group (systemd's KillMode=control-group, `kubectl
delete`) left the segment dead (the scheduler died of its SIGTERM before its launcher could
stop it), paging someone for a routine stop; and a scheduler exception read "closed
cleanly" (SGLang's launcher kills the tree on the scheduler's SIGQUIT, and the plugin closed
every live child's segment).

Routine: SIGTERM and SIGINT to the process group (SIGTERM to the launcher alone is
test_sglang_server.py's restart test). Faults: an exception in the scheduler (SGLang's own
crash switch, ``SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS``: a RuntimeError raised in its
output streamer, on the real exception path; no request reached a real one on CPU), the
scheduler SIGKILLed alone (an OOM kill), the launcher SIGKILLed (SGLang's schedulers die
with it: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal

import pytest

from kvsidecar.bench import fleet
from kvsidecar.bench import sglang as sb
from kvsidecar.bench import vllm as vb
from tests.engines import ends
from tests.engines import sglang_server as ss
from tests.engines.envs import engine_python

SEGMENT = "kvsidecar.sglang.dp0.tp0.pp0"
ROUTINE = ("group-sigterm", "group-sigint")
FAULTS = {  # how -> the target's error_kind
    "scheduler-exception": "faulted",
    "scheduler-sigkill": "writer_dead",
    "launcher-sigkill": "writer_dead",
}
# Past the warm-up request's outputs (it crashed at 3, during start-up), within ours.
CRASH_AFTER = {"SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS": "30"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", (*ROUTINE, *FAULTS))
def test_each_end_of_an_sglang_server_reads_as_it_should(how, tmp_path):
    python = engine_python("sglang")
    if (problem := ss.standin_problem(python)) is not None:
        pytest.fail(problem)
    shm = tmp_path / "shm"
    shm.mkdir()
    port = fleet.free_port()
    cmd = sb.server_command(python, ss.model_dir(tmp_path / "model"), port, 2048)
    extra = CRASH_AFTER if how == "scheduler-exception" else {}
    log = tmp_path / "server.log"
    server = vb.start_server(cmd, sb.server_env(shm, **extra), log, timeout=420)
    (scheduler,) = ss.scheduler_pids(server.pid)
    daemon = None
    try:
        daemon, url, gateway = ends.start_daemon(shm, tmp_path)
        assert ends.gateway_answer(gateway)[0] == 200
        assert ends.record_of(url, SEGMENT).get("state") == "up"
        if how == "group-sigterm":
            os.killpg(server.pid, signal.SIGTERM)
        elif how == "group-sigint":
            os.killpg(server.pid, signal.SIGINT)
        elif how == "scheduler-exception":
            try:
                sb.generate(port, [list(range(1, 40))], 64)
            except Exception:
                pass  # the request dies with the scheduler
        elif how == "scheduler-sigkill":
            os.kill(scheduler, signal.SIGKILL)
        elif how == "launcher-sigkill":
            os.kill(server.pid, signal.SIGKILL)
        if how in ROUTINE:
            ends.expect_closed_cleanly(SEGMENT, url, gateway, shm, log)
        else:
            ends.expect_dead(SEGMENT, FAULTS[how], url, gateway, shm, log, tmp_path)
        if how == "scheduler-exception":
            assert "Test crash after stream_output" in log.read_text()
    finally:
        if daemon is not None:
            fleet.stop_daemon(daemon)
        ss.stop(server)
