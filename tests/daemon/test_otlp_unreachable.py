"""`kvsidecar serve --otlp.endpoint` to a stalled and to a dead collector, real processes:
scrapes and probes answer as promptly as a daemon's without the push, and the drops
self-metric rises (issue 34, "the push must never hurt the rest")."""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import time

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs kvsidecar[otlp]")

from tests.otlp_receiver import StalledReceiver, dead_port
from tests.procs import start_daemon, wait_for

from .scrape import fetch, value

WAIT_S = 120.0  # an "eventually", not a speed bound: a shared 2-core host
ROUNDS = 12
DROPPED = "kvsidecar_otlp_dropped_batches_total"
# The exporter's timeout is max(1 s, interval): a 10 s interval keeps one export hanging on
# the stalled receiver for 10 s, so a scrape that waited on it would take seconds, not ms.
STALL_INTERVAL = "10"


def _serve(shm_dir: str, *extra: str) -> tuple[subprocess.Popen, str]:
    return start_daemon(shm_dir, "--poll-interval", "0.1", *extra)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0  # the push threads do not hold up a clean exit


def _timed(url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    status, _, body = fetch(url)
    assert status == 200, (url, status)
    return time.perf_counter() - t0, body


def _latencies(base: str, push: str) -> dict[str, list[float]]:
    """Interleaved scrapes and probes of both daemons: host load hits both alike."""
    out: dict[str, list[float]] = {k: [] for k in ("base", "push", "base_h", "push_h")}
    for _ in range(ROUNDS):
        out["base"].append(_timed(base + "/metrics")[0])
        out["push"].append(_timed(push + "/metrics")[0])
        out["base_h"].append(_timed(base + "/-/healthy")[0])
        out["push_h"].append(_timed(push + "/-/healthy")[0])
    return out


def _assert_as_prompt(lat: dict[str, list[float]]) -> None:
    # Relative to the baseline, with room for a loaded host; a scrape waiting on the
    # hung export would take seconds (or hit fetch's 5 s timeout) and fail this.
    for push, base in (("push", "base"), ("push_h", "base_h")):
        m_push, m_base = statistics.median(lat[push]), statistics.median(lat[base])
        print(f"median {push} {m_push * 1e3:.1f} ms vs {base} {m_base * 1e3:.1f} ms")
        assert m_push <= 5 * m_base + 0.5, lat


def _dropped(url: str, reason: str) -> float:
    return value(fetch(url + "/metrics")[2], DROPPED, reason=reason) or 0.0


def test_stalled_collector(shm_dir: str, rank: None) -> None:
    recv = StalledReceiver()
    endpoint = f"http://127.0.0.1:{recv.port}/v1/metrics"
    base, base_url = _serve(shm_dir)
    push, push_url = _serve(shm_dir, "--otlp.endpoint", endpoint, "--otlp.interval", STALL_INTERVAL)
    try:
        # The first push goes out at start and hangs: the receiver holds its connection.
        assert wait_for(lambda: len(recv.conns) >= 1, WAIT_S)
        hung_at = time.monotonic()
        lat = _latencies(base_url, push_url)
        pending = _dropped(push_url, "send_failed") == 0
        if time.monotonic() - hung_at < float(STALL_INTERVAL) * 0.8:
            assert pending  # so every scrape above ran while that export hung
        _assert_as_prompt(lat)
        # The counter is there from the start, and counts the export the stall times out.
        assert wait_for(lambda: _dropped(push_url, "send_failed") >= 1, WAIT_S)
        print("scraped while an export hung:", pending)
        assert DROPPED not in fetch(base_url + "/metrics")[2]  # no series without the push
    finally:
        _stop(push)
        _stop(base)
        recv.close()


def test_dead_collector(shm_dir: str, rank: None) -> None:
    endpoint = f"http://127.0.0.1:{dead_port()}/v1/metrics"
    base, base_url = _serve(shm_dir)
    # A short interval: the push works (and fails) as often as it may, the worst case for
    # the scrapes sharing its process.
    push, push_url = _serve(shm_dir, "--otlp.endpoint", endpoint, "--otlp.interval", "0.2")
    try:
        assert wait_for(lambda: _dropped(push_url, "send_failed") >= 1, WAIT_S)
        _assert_as_prompt(_latencies(base_url, push_url))
        before = _dropped(push_url, "send_failed")
        assert wait_for(lambda: _dropped(push_url, "send_failed") > before, WAIT_S)
    finally:
        _stop(push)
        _stop(base)


def test_promtool_accepts_the_drops_family(shm_dir: str, rank: None) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    endpoint = f"http://127.0.0.1:{dead_port()}/v1/metrics"
    push, url = _serve(shm_dir, "--otlp.endpoint", endpoint, "--otlp.interval", "0.2")
    try:
        assert wait_for(lambda: _dropped(url, "send_failed") >= 1, WAIT_S)
        text = fetch(url + "/metrics")[2]
        assert f'{DROPPED}{{reason="queue_full"}}' in text
        r = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        _stop(push)
