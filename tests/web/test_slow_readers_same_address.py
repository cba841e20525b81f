"""Slow /metrics readers on the prober's own address cannot refuse its probes (issue 31
defect 4): a kubelet probes from the node's address, which every hostNetwork pod shares.
Scrapes queued for a render slot were not evictable, so at the cap a probe from that
address found nothing to close once the few connections being written to were gone.

Counted, not timed: the share of `/-/healthy` probes answered within a generous timeout."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvsidecar.web.request import Request
from kvsidecar.web.server import WebServer

from .hostile import answered_probes, attackers, port_of

READERS = 48  # from 127.0.0.1, like the probes
CAP = 32
PROBES = 20
BODY = b"# slow\n" * (1 << 19)  # ~3.5 MB: never fits the socket buffers unread


def _metrics(request: Request) -> tuple[bytes, str]:
    time.sleep(0.3)  # a render holds its slot a while
    return BODY, "text/plain; version=0.0.4"


@pytest.fixture
def server() -> Iterator[WebServer]:
    web = WebServer(
        {"/metrics": _metrics},
        ["127.0.0.1:0"],
        max_connections=CAP,
        max_requests=2,
        request_timeout_s=10.0,
    )
    web.start()
    yield web
    web.shutdown()


def _read_slowly(port: int, stop: threading.Event, sent: list[int]) -> None:
    """Ask for /metrics and never read the answer; reconnect when closed."""
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                sent[0] += 1
                while not stop.is_set():
                    s.settimeout(0.2)
                    try:
                        if not s.recv(1, socket.MSG_PEEK):
                            break  # closed by the server
                    except TimeoutError:
                        pass
                    time.sleep(0.5)
        except OSError:
            time.sleep(0.05)


def test_probes_answered_among_slow_readers_of_their_own_address(server: WebServer) -> None:
    port = port_of(server)
    sent = [0]
    with attackers(lambda k, stop: _read_slowly(port, stop, sent), READERS):
        time.sleep(1.5)  # the cap is full: a few being written to, the rest queued
        answered = answered_probes(port, PROBES)
        assert sum(sent) >= CAP, "the readers did not connect"
    print(f"answered {answered}/{PROBES}")  # the figure, for -rP
    # The issue measured 0/10 and 0/11 answered; main answers 10-12/20 here, this branch
    # 16-20/20 (a reader reconnecting can still close a probe not yet past its grace).
    # The goal is 95 %; the bound tells the two apart on a loaded host.
    assert answered >= PROBES * 0.75, f"{answered}/{PROBES} probes answered"
