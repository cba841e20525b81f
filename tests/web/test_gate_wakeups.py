"""The gate does work per byte a parked connection sends, not per parked connection per
wake-up (issue 31 shape 6). Parked connections keep their bytes unread (the gate peeks),
so a level-triggered watch reported every one that had sent anything on every wake-up:
the gate spun, peeking them all again and again (1,000 tricklers: 85 % of a core at a
byte per 5 s each; now ~1 %). Counted: how often the gate looks at a parked connection
while 200 half-heads sit still, never how long anything took."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from kvsidecar.web.server import WebServer

from .hostile import answered_probes, port_of

PARKED = 200


@pytest.fixture
def web() -> Iterator[WebServer]:
    server = WebServer(
        {"/metrics": lambda request: (b"up 1\n", "text/plain; version=0.0.4")},
        ["127.0.0.1:0"],
        request_timeout_s=30.0,
    )
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


def test_still_parked_connections_are_not_looked_at_again(web: WebServer) -> None:
    gate = web._front.gate
    assert gate is not None
    looks = [0]
    readable = gate._readable

    def counted(sock: socket.socket) -> None:
        looks[0] += 1
        readable(sock)

    gate._readable = counted  # type: ignore[method-assign]
    port = port_of(web)
    with ExitStack() as stack:
        for _ in range(PARKED):
            s = stack.enter_context(socket.create_connection(("127.0.0.1", port), 5))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # never finished
        deadline = time.monotonic() + 10
        while gate.parked < PARKED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.parked >= PARKED
        time.sleep(0.5)
        before = looks[0]
        time.sleep(2.0)  # nobody sends anything
        idle_looks = looks[0] - before
        assert answered_probes(port, 5) == 5
    # One look per segment sent; while nobody sends, (almost) none. Level-triggered:
    # every parked connection on every wake-up, tens of thousands in 2 s.
    assert idle_looks <= PARKED // 10, f"{idle_looks} looks at {PARKED} silent parked connections"
