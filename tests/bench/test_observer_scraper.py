"""The observer benchmark's scraper process: bounded in time whatever the target does.

CI once hung 30 s on it (a trickling /metrics); these run the real scraper program against
real sockets.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvsidecar.bench.vllm import SCRAPER


def _scrape(port: int, hz: float, seconds: float) -> tuple[tuple[int, int], float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", SCRAPER, "127.0.0.1", str(port), "/metrics", str(hz), str(seconds)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    ok, failed = (int(x) for x in out.split())
    return (ok, failed), time.monotonic() - t0


@pytest.fixture
def trickler() -> Iterator[int]:
    """Sends a promising header, then one body byte a second, forever."""
    lsock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not stop.wait(1.0):
                conn.sendall(b"x")
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield lsock.getsockname()[1]
    stop.set()
    lsock.close()


def test_a_trickling_target_counts_as_failed_and_does_not_hang_the_scraper(trickler: int) -> None:
    (ok, failed), wall = _scrape(trickler, hz=20, seconds=1.0)
    assert ok == 0 and failed >= 1
    # Its own deadline is seconds + 3; a per-byte socket timeout alone would never end, so
    # ending at all (_scrape's 60 s timeout, 15x that deadline) is the check.
    assert wall >= 1.0  # it kept trying for its whole window: a lower bound, load-proof


def test_a_healthy_target_is_scraped_at_about_the_asked_rate() -> None:
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"up 1\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    Metrics.protocol_version = "HTTP/1.1"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (ok, failed), _ = _scrape(server.server_address[1], hz=20, seconds=1.5)
    finally:
        server.shutdown()
    assert failed == 0
    # At most the asked rate (load can only lower it); at least 5 round trips of a 5-byte
    # body in 1.5 s (~ms each here), and the scraper catches up after a stall.
    assert 5 <= ok <= 31


def test_a_closed_port_counts_failures_and_ends_on_time() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (ok, failed), wall = _scrape(port, hz=20, seconds=1.0)
    assert ok == 0 and failed >= 5
    assert wall >= 1.0  # its whole window; ending at all is bounded by _scrape's timeout
