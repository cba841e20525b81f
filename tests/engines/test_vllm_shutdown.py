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
import time
import urllib.request

import pytest

from kvsidecar.bench import fleet
from kvsidecar.bench import vllm as vb
from tests.engines.envs import engine_python, vllm_server_env
from tests.support.procs import wait_for

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

        def one(p: list[int]) -> None:
            with urllib.request.urlopen(vb.complete(port, p, 150), timeout=120) as r:
                assert r.status == 200

        # Six requests that outgrow the 16 blocks together preempt only if they overlap; on
        # a loaded host they can arrive staggered and none is preempted (seen once, vLLM's
        # own count 0 as well). So the batch repeats, new prompts each time, until vLLM has
        # preempted.
        for round_ in range(4):
            prompts = [[(7 * i + j + 11 * round_) % 500 + 1 for j in range(60)] for i in range(6)]
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
                list(ex.map(one, prompts))
            metrics = vb.scrape(f"http://127.0.0.1:{port}/metrics")
            if vb.value(metrics, "vllm:num_preemptions_total") > 0:
                break
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


def _engine_core(server_pid: int) -> int:
    """The EngineCore process among the API server's descendants (vLLM names it)."""
    return vllm_child(server_pid, b"EngineCore")


def vllm_child(server_pid: int, title: bytes) -> int:
    """The first of the API server's descendants whose command line names `title`."""
    from kvsidecar.bench import proccount

    for pid in proccount.tree(server_pid)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if title in f.read():
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no {title.decode()} process under {server_pid}")


def _source_up_series(metrics_url: str, segment: str = SEGMENT) -> tuple[str, float] | None:
    """The exposition line of the segment's kvsidecar_source_up, as Prometheus stores it."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvsidecar_source_up{") and f'segment="{segment}"' in line:
                series, _, value = line.rpartition(" ")
                return series, float(value)
    return None


def _source_down_fires(series: str, value: float, tmp_path, segment: str = SEGMENT) -> bool:
    """promtool's verdict on the shipped rules: does KvsidecarSourceDown fire for `series`
    held at `value` (scraped every 15 s) after 2 minutes? Asked as "no alert expected", so
    promtool's failure lists what fired (its annotations need not be restated here)."""
    import yaml

    from tests.deploy.support import DEPLOY, require_tool

    promtool = require_tool("promtool", "apt-get install prometheus")
    test = {
        "rule_files": [str(DEPLOY / "prometheus" / "kvsidecar-rules.yml")],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": [{"series": series, "values": f"{value:g}x12"}],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "KvsidecarSourceDown", "exp_alerts": []}
            ],
        }],
    }  # fmt: skip
    path = tmp_path / "source-down.test.yml"
    path.write_text(yaml.safe_dump(test))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode == 0:
        return False
    got = text.partition("got:")[2]
    assert got, text  # failed for another reason than a firing alert
    return f'segment="{segment}"' in got and 'severity="warning"' in got


@pytest.mark.timeout(420)
def test_a_crashed_engine_core_reads_dead_never_closed_cleanly(tmp_path, tmp_path_factory):
    """SIGKILL of vLLM's EngineCore alone (an OOM kill, a crash): vLLM's API server logs
    "engine core exited unexpectedly" and shuts down, running the process manager's shutdown
    that our plugin wraps. The crashed core's segment must read dead, stay exported as
    kvsidecar_source_up 0, and fire KvsidecarSourceDown (promtool, shipped rules); it was
    read "closed cleanly" and forgotten within a second, so no alert could fire."""
    python = engine_python("vllm")
    shm = tmp_path / "shm"
    shm.mkdir()
    port = fleet.free_port()
    env = vllm_server_env(shm, tmp_path_factory)
    cmd = vb.server_command(python, vb.write_model(tmp_path / "model"), port, num_gpu_blocks=64)
    log = tmp_path / "server.log"
    server = vb.start_server(cmd, env, log, timeout=240)
    daemon = None
    try:
        daemon, url = fleet.start_daemon(str(shm), "--poll-interval", "0.1", timeout=60)
        core = _engine_core(server.pid)
        os.kill(core, signal.SIGKILL)
        record: dict = {}

        def dead() -> bool:
            nonlocal record
            targets = _json(f"{url}/api/v1/snapshots")["targets"]
            record = next((t for t in targets if t["segment"] == SEGMENT), {})
            return record.get("state") == "dead"

        assert wait_for(dead, 30, 0.2), record
        # vLLM cleans up after the dead core (its API server exits or stops serving): wait
        # for that cleanup, then the segment must still read as a crash.
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            pass
        assert wait_for(
            lambda: "exited unexpectedly" in log.read_text() or server.poll() is not None, 60
        )
        for _ in range(3):  # across several polls and a rediscovery
            assert dead(), record
            assert "closed cleanly" not in str(record.get("error")), record
            assert record.get("error_kind", "") != "closed", record
            time.sleep(1.0)
        assert (shm / SEGMENT).exists(), "a crashed core's segment was unlinked as if closed"
        found = _source_up_series(f"{url}/metrics")
        assert found is not None and found[1] == 0, found
        assert _source_down_fires(*found, tmp_path), found
    finally:
        if daemon is not None:
            fleet.stop_daemon(daemon)
        vb.stop_server(server)
