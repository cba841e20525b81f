"""`bench gateway_floor`'s ``native`` candidate: the compiled loop with no interpreter
answers a picker's kept-alive polls with the floor's response, one per request, and
measures its own thread's CPU. Real sockets, the real extension."""

from __future__ import annotations

import http.client
import socket

import pytest

from kvsidecar.bench import gateway_floor
from kvsidecar.web import poll_server

pytestmark = pytest.mark.skipif(
    not hasattr(poll_server._pollfast, "native_floor"), reason="extension not built"
)


def test_native_candidate_answers_each_poll_and_counts_its_cpu() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    # Until 5 answers are sent (60 s: an "eventually" on a loaded host, not a bound).
    floor = gateway_floor.NativeFloor(sock, 60.0, most=5)
    floor.start()
    conn = http.client.HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=30)
    try:
        bodies = []
        for _ in range(5):  # kept alive: all five on one connection
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.getheader("Content-Type") == "text/plain; version=0.0.4"
            bodies.append(resp.read())
        assert bodies == [b"# TYPE floor gauge\nfloor 1.0\n"] * 5
    finally:
        conn.close()
        floor.shutdown()
    polls, cpu_ns = floor.result
    assert polls == 5
    assert cpu_ns > 0
    assert "native" in gateway_floor.CANDIDATES
