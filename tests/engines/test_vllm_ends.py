"""Every way a real vLLM server ends, read as it should (issue 41, item 1): a routine stop
reads "closed cleanly"; a fault reads dead, its file kept, its target kept and exported as
``kvsidecar_source_up 0`` (so KvsidecarSourceDown fires), and the gateway answers 503,
over 20 s after the end. Before: vLLM's own fatal error (a seeded n=2 request with a
chunked prefill: its worker raises "CPU Generator does not use offset") read "closed
cleanly" and was forgotten in ~1 s (its API server runs the same timeout-0 shutdown as a
routine SIGTERM), and an engine core whose API server was SIGKILLed read "up" for ever.

The ends (each a fresh server, its defaults but for a small KV space and prefill chunk):
routine: SIGTERM and SIGINT to the whole process group (systemd's KillMode=control-group,
Ctrl-C in a terminal); SIGTERM to the API server alone and SIGKILL of the engine core
alone are tests/engines/test_vllm_shutdown.py's. Faults: the worker's exception (vLLM's
real bug, one request), the worker process SIGKILLed (an OOM kill), the API server
SIGKILLed (its engine core lives on, orphaned).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request

import pytest

from kvsidecar.bench import fleet
from kvsidecar.bench import vllm as vb
from tests.engines import ends
from tests.engines.envs import engine_python, vllm_server_env
from tests.engines.test_vllm_shutdown import _engine_core, vllm_child

SEGMENT = "kvsidecar.vllm.dp0.tp0.pp0"
ROUTINE = ("group-sigterm", "group-sigint")
FAULTS = ("worker-exception", "worker-sigkill", "api-sigkill")


def _seeded_n2(port: int) -> int:
    """vLLM 0.32's own CPU bug: n=2 + seed + a prefill in chunks -> its worker raises."""
    body = {
        "model": "tiny", "prompt": list(range(1, 201)), "max_tokens": 8,
        "n": 2, "seed": 7, "temperature": 1.0,
    }  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _end(how: str, server: subprocess.Popen, port: int) -> None:
    if how == "group-sigterm":
        os.killpg(server.pid, signal.SIGTERM)
    elif how == "group-sigint":
        os.killpg(server.pid, signal.SIGINT)
    elif how == "worker-exception":
        assert _seeded_n2(port) == 500
    elif how == "worker-sigkill":
        os.kill(vllm_child(server.pid, b"Worker"), signal.SIGKILL)
    elif how == "api-sigkill":
        os.kill(server.pid, signal.SIGKILL)
    else:
        raise AssertionError(how)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("how", ROUTINE + FAULTS)
def test_each_end_of_a_vllm_server_reads_as_it_should(how, tmp_path, tmp_path_factory):
    python = engine_python("vllm")
    shm = tmp_path / "shm"
    shm.mkdir()
    port = fleet.free_port()
    cmd = vb.server_command(
        python,
        vb.write_model(tmp_path / "model"),
        port,
        num_gpu_blocks=64,
        extra=("--max-num-batched-tokens", "64", "--max-model-len", "512"),
    )
    log = tmp_path / "server.log"
    server = vb.start_server(cmd, vllm_server_env(shm, tmp_path_factory), log, timeout=300)
    core = _engine_core(server.pid)
    daemon = None
    try:
        daemon, url, gateway = ends.start_daemon(shm, tmp_path)
        assert ends.gateway_answer(gateway)[0] == 200
        assert ends.record_of(url, SEGMENT).get("state") == "up"
        _end(how, server, port)
        if how in ROUTINE:
            ends.expect_closed_cleanly(SEGMENT, url, gateway, shm, log)
        else:
            ends.expect_dead(SEGMENT, "faulted", url, gateway, shm, log, tmp_path)
        if how == "api-sigkill":
            assert "orphaned" in log.read_text(), log.read_text()[-3000:]
    finally:
        if daemon is not None:
            fleet.stop_daemon(daemon)
        vb.stop_server(server)
        try:
            os.kill(core, signal.SIGKILL)  # an orphaned core is in no process group of ours
        except ProcessLookupError:
            pass
