"""`kvsidecar serve --otlp.endpoint` to a stalled and to a dead collector, real processes:
scrapes, probes and gateway polls answer as promptly as a daemon's without the push, and
the drops self-metric rises (issue 34, "the push must never hurt the rest")."""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import time

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs kvsidecar[otlp]")

from kvsidecar.bench.fleet import free_port_run
from tests.support.otlp_receiver import StalledReceiver, dead_port
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch, value

WAIT_S = 120.0  # an "eventually", not a speed bound: a shared 2-core host
ROUNDS = 12
DROPPED = "kvsidecar_otlp_dropped_batches_total"
# The exporter's timeout is max(1 s, interval): a 10 s interval keeps one export hanging on
# the stalled receiver for 10 s, so a scrape that waited on it would take seconds, not ms.
STALL_INTERVAL = "10"


# What is timed on each daemon: a scrape, a probe, and a picker's poll of the gateway.
CHECKS = {"/metrics": "web", "/-/healthy": "web", "gateway /metrics": "gateway"}


def _serve(shm_dir: str, *extra: str) -> tuple[subprocess.Popen, dict[str, str]]:
    gateway = f"127.0.0.1:{free_port_run()}"
    proc, url = start_daemon(
        shm_dir, "--poll-interval", "0.1", "--gateway.listen-address", gateway, *extra
    )
    return proc, {"web": url, "gateway": "http://" + gateway}


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0  # the push threads do not hold up a clean exit


def _timed(url: str) -> float:
    t0 = time.perf_counter()
    status, _, _ = fetch(url)
    assert status == 200, (url, status)
    return time.perf_counter() - t0


def _latencies(base: dict[str, str], push: dict[str, str]) -> dict[tuple[str, str], list]:
    """Interleaved requests to both daemons: host load hits both alike."""
    out: dict[tuple[str, str], list] = {}
    for _ in range(ROUNDS):
        for check, listener in CHECKS.items():
            path = check.split()[-1]
            for who, urls in (("base", base), ("push", push)):
                out.setdefault((who, check), []).append(_timed(urls[listener] + path))
    return out


def _assert_as_prompt(lat: dict[tuple[str, str], list]) -> None:
    # Relative to the baseline, with room for a loaded host; a request waiting on the
    # hung export would take seconds (or hit fetch's 5 s timeout) and fail this.
    for check in CHECKS:
        m_push = statistics.median(lat[("push", check)])
        m_base = statistics.median(lat[("base", check)])
        print(f"{check}: median {m_push * 1e3:.1f} ms with the push, {m_base * 1e3:.1f} without")
        assert m_push <= 5 * m_base + 0.5, (check, lat)


def _dropped(urls: dict[str, str], reason: str) -> float:
    return value(fetch(urls["web"] + "/metrics")[2], DROPPED, reason=reason) or 0.0


def test_stalled_collector(shm_dir: str, rank: None) -> None:
    recv = StalledReceiver()
    endpoint = f"http://127.0.0.1:{recv.port}/v1/metrics"
    base, base_urls = _serve(shm_dir)
    push, push_urls = _serve(
        shm_dir, "--otlp.endpoint", endpoint, "--otlp.interval", STALL_INTERVAL
    )
    try:
        # The first push goes out at start and hangs: the receiver holds its connection.
        assert wait_for(lambda: len(recv.conns) >= 1, WAIT_S)
        hung_at = time.monotonic()
        lat = _latencies(base_urls, push_urls)
        pending = _dropped(push_urls, "send_failed") == 0
        if time.monotonic() - hung_at < float(STALL_INTERVAL) * 0.8:
            assert pending  # so every scrape above ran while that export hung
        _assert_as_prompt(lat)
        # The counter is there from the start, and counts the export the stall times out.
        assert wait_for(lambda: _dropped(push_urls, "send_failed") >= 1, WAIT_S)
        print("scraped while an export hung:", pending)
        assert DROPPED not in fetch(base_urls["web"] + "/metrics")[2]  # none without a push
    finally:
        _stop(push)
        _stop(base)
        recv.close()


def test_dead_collector(shm_dir: str, rank: None) -> None:
    endpoint = f"http://127.0.0.1:{dead_port()}/v1/metrics"
    base, base_urls = _serve(shm_dir)
    # A short interval: the push works (and fails) as often as it may, the worst case for
    # the scrapes sharing its process.
    push, push_urls = _serve(shm_dir, "--otlp.endpoint", endpoint, "--otlp.interval", "0.2")
    try:
        assert wait_for(lambda: _dropped(push_urls, "send_failed") >= 1, WAIT_S)
        _assert_as_prompt(_latencies(base_urls, push_urls))
        before = _dropped(push_urls, "send_failed")
        assert wait_for(lambda: _dropped(push_urls, "send_failed") > before, WAIT_S)
        # Nothing accepted: the series KvsidecarOtlpPushFailing watches stays at 0.
        text = fetch(push_urls["web"] + "/metrics")[2]
        assert value(text, "kvsidecar_otlp_exported_batches_total") == 0
    finally:
        _stop(push)
        _stop(base)


def test_promtool_accepts_the_drops_family(shm_dir: str, rank: None) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    endpoint = f"http://127.0.0.1:{dead_port()}/v1/metrics"
    push, urls = _serve(shm_dir, "--otlp.endpoint", endpoint, "--otlp.interval", "0.2")
    try:
        assert wait_for(lambda: _dropped(urls, "send_failed") >= 1, WAIT_S)
        text = fetch(urls["web"] + "/metrics")[2]
        assert f'{DROPPED}{{reason="queue_full"}}' in text
        r = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        _stop(push)
