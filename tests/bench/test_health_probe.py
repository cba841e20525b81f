"""bench cost --sglang's health prober: rounds hold only their own samples, a slow health
endpoint shows in the latencies, and the summary pairs each round with its own none."""

from __future__ import annotations

import http.server
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from kvsidecar.bench import fleet, health_probe


class _Handler(http.server.BaseHTTPRequestHandler):
    delay_s = 0.0  # what /health costs: set by the test

    def do_GET(self) -> None:
        time.sleep(self.delay_s if self.path == "/health" else 0.05)
        self.send_response(200 if self.path in health_probe.PATHS else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    port = fleet.free_port()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield port
    httpd.shutdown()
    httpd.server_close()


def test_rounds_hold_their_own_samples_and_see_a_slow_health(server: int) -> None:
    prober = health_probe.HealthProber(server, hz=20)
    try:
        _Handler.delay_s = 0.0
        prober.start()
        time.sleep(1.0)
        fast = prober.stop()
        time.sleep(0.5)  # between rounds the prober fetches nothing
        _Handler.delay_s = 0.03
        prober.start()
        time.sleep(1.0)
        slow = prober.stop()
    finally:
        prober.close()
    for r in (fast, slow):
        assert 8 <= len(r["/health"]) <= 25, r  # 20 Hz for 1 s, on a loaded host
        assert r["/health_generate"] and not r["failed"], r
    # Every slow answer waited its 30 ms; the fast round's median did not (its max may, on
    # a loaded host).
    assert statistics.median(fast["/health"]) < 30 <= min(slow["/health"]), (fast, slow)


def test_summary_pairs_rounds_with_their_own_none() -> None:
    # Round k: none's /health takes k ms, the scraped condition's 3k ms: the host drifts,
    # the paired ratio stays 3.
    rounds = [
        {
            "none": {"/health": [float(k)] * 50, "/health_generate": [1000.0], "failed": []},
            "x@50": {"/health": [3.0 * k] * 50, "/health_generate": [1000.0], "failed": []},
        }
        for k in (1, 2, 5, 10)
    ]
    s = health_probe.summarize(rounds, ("none", "x@50"))
    h = s["/health"]["x@50"]
    assert h["samples"] == 200 and h["failed"] == 0
    assert h["p50_ratio"]["geomean"] == pytest.approx(3.0)
    assert h["p50_ratio"]["ci95"] == pytest.approx([3.0, 3.0])
    assert h["p99_ms"]["mean"] == pytest.approx(3.0 * (1 + 2 + 5 + 10) / 4)
    assert s["/health_generate"]["x@50"]["p50_ratio"]["geomean"] == pytest.approx(1.0)
    assert len(health_probe.rows(s)) == 4
