"""Real vLLM OpenAI server with its default flags (issue #23, item 4): preemptions are
exported as their own counter, equal to vLLM's `vllm:num_preemptions_total`, and a routine
stop (SIGTERM to the API server only, as Kubernetes and systemd send it) reads as "closed
cleanly", not as a crash: with the default `--shutdown-timeout 0` vLLM SIGKILLs the engine
core right after SIGTERM, before the scheduler's shutdown can close the segment.

One server (startup is 40-70 s on a 2-core host): KV space for 16 blocks, six long requests
at once, so the scheduler must preempt.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import urllib.request

import pytest

from kvsidecar.bench import fleet
from kvsidecar.bench import vllm as vb
from tests.engines.envs import engine_python, vllm_server_env
from tests.procs import wait_for

SEGMENT = "kvsidecar.vllm.dp0.tp0.pp0"


def _json(url: str) -> dict:
    import json

    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.timeout(420)
def test_preemptions_match_vllm_and_a_default_stop_is_a_clean_close(tmp_path, tmp_path_factory):
    python = engine_python("vllm")
    shm = tmp_path / "shm"
    shm.mkdir()
    port = fleet.free_port()
    env = vllm_server_env(shm, tmp_path_factory)
    # vLLM's defaults otherwise: no --shutdown-timeout.
    cmd = vb.server_command(
        python,
        vb.write_model(tmp_path / "model"),
        port,
        num_gpu_blocks=16,
        extra=("--max-model-len", "256"),
    )
    assert not [a for a in cmd if a.startswith("--shutdown-timeout")]
    log = tmp_path / "server.log"
    server = vb.start_server(cmd, env, log, timeout=240)
    daemon = None
    try:
        daemon_log = open(tmp_path / "daemon.log", "wb")
        # A long rediscover interval: the closed target stays listed long enough to be read.
        daemon, url = fleet.start_daemon(
            str(shm),
            "--poll-interval",
            "0.1",
            "--rediscover-interval",
            "30",
            timeout=60,
            stderr=daemon_log,
        )
        prompts = [[(7 * i + j) % 500 + 1 for j in range(60)] for i in range(6)]

        def one(p: list[int]) -> None:
            with urllib.request.urlopen(vb.complete(port, p, 150), timeout=120) as r:
                assert r.status == 200

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
            list(ex.map(one, prompts))
        theirs = ours = -1.0

        def agree() -> bool:
            nonlocal theirs, ours
            theirs = vb.value(
                vb.scrape(f"http://127.0.0.1:{port}/metrics"), "vllm:num_preemptions_total"
            )
            ours = vb.value(vb.scrape(f"{url}/metrics"), "kvsidecar_preemptions_total")
            return theirs == ours

        assert wait_for(agree, 15, 0.2), (theirs, ours)
        assert ours > 0, "the workload was sized to preempt"

        # A routine stop: SIGTERM to the API server process only, default flags.
        os.kill(server.pid, signal.SIGTERM)
        server.wait(60)
        record: dict = {}

        def closed() -> bool:
            nonlocal record
            targets = _json(f"{url}/api/v1/snapshots")["targets"]
            record = next((t for t in targets if t["segment"] == SEGMENT), {})
            return "closed cleanly" in str(record.get("error", ""))

        assert wait_for(closed, 15, 0.2), (record, log.read_text()[-4000:])
        assert not (shm / SEGMENT).exists(), "the stopped engine's segment is left behind"
        # Closed before the kill: the daemon never saw a crash in between.
        assert "writer is gone" not in (tmp_path / "daemon.log").read_text()
        lines = [ln for ln in log.read_text().splitlines() if "closed its segment" in ln]
        # Logged through vLLM's logger, in vLLM's format.
        assert len(lines) == 1 and " INFO " in lines[0] and SEGMENT in lines[0], lines
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        vb.stop_server(server)
