"""What a test of an engine's end checks (issue 41, item 1), for the real vLLM and SGLang
servers alike: a routine stop reads "closed cleanly" and its file is gone; a fault reads
dead at every look for WATCH_S (the daemon's record, the file kept, the gateway's 503), its
``kvsidecar_source_up`` series stays 0 and the shipped KvsidecarSourceDown alert fires."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

from kvsidecar.bench import fleet
from tests.engines.test_vllm_shutdown import _source_down_fires, _source_up_series
from tests.support.procs import wait_for

WATCH_S = 20.0


def start_daemon(shm, tmp_path) -> tuple[subprocess.Popen, str, str]:
    """`kvsidecar serve` on `shm` with a gateway: (daemon, its URL, the gateway's rank-0 URL).
    A closed target stays listed long enough to be read (forgotten at the next rediscovery
    once its file is gone)."""
    gateway_port = fleet.free_port_run()
    daemon, url = fleet.start_daemon(
        str(shm),
        "--poll-interval", "0.1",
        "--rediscover-interval", "60",
        "--gateway.listen-address", f"127.0.0.1:{gateway_port}",
        timeout=60,
        stderr=open(tmp_path / "daemon.log", "wb"),
    )  # fmt: skip
    return daemon, url, f"http://127.0.0.1:{gateway_port}/metrics"


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def record_of(url: str, segment: str) -> dict:
    targets = _json(f"{url}/api/v1/snapshots")["targets"]
    return next((t for t in targets if t["segment"] == segment), {})


def gateway_answer(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def expect_closed_cleanly(segment: str, url: str, gateway: str, shm, log) -> None:
    record: dict = {}

    def closed() -> bool:
        nonlocal record
        record = record_of(url, segment)
        return record.get("error_kind") == "closed"

    assert wait_for(closed, 60, 0.2), (record, log.read_text()[-3000:])
    assert "closed cleanly" in record["error"]
    assert not (shm / segment).exists(), "a stopped engine's segment is left behind"
    assert gateway_answer(gateway)[0] == 503
    assert "FAULTED" not in log.read_text()


def expect_dead(segment: str, kind: str, url: str, gateway: str, shm, log, tmp_path) -> None:
    record: dict = {}

    def dead() -> bool:
        nonlocal record
        record = record_of(url, segment)
        return record.get("state") == "dead"

    assert wait_for(dead, 60, 0.2), (record, log.read_text()[-3000:])
    # Whatever vLLM does next (its API server's timeout-0 shutdown, or nothing at all for
    # an orphan), the target reads dead at every look for WATCH_S.
    deadline = time.monotonic() + WATCH_S
    looks = 0
    while time.monotonic() < deadline:
        record = record_of(url, segment)
        assert record.get("state") == "dead", record
        assert record.get("error_kind") == kind, record
        assert "closed cleanly" not in str(record.get("error")), record
        assert (shm / segment).exists(), "a faulted engine's segment was removed"
        status, body = gateway_answer(gateway)
        assert status == 503 and "dead" in body, (status, body)
        looks += 1
        time.sleep(1.0)
    assert looks >= 10
    found = _source_up_series(f"{url}/metrics", segment)
    assert found is not None and found[1] == 0, found
    assert _source_down_fires(*found, tmp_path, segment), found
    if kind == "faulted":
        assert "marked FAULTED" in log.read_text()
