"""A complete head handed to a front that turns out full waits at the gate again: it
neither closes a request of its own address still owed its answer nor is refused.

The gate hands a head on when the front has room, counting the front's closable
connections (a stalled reader, an idle keep-alive) as room; that count is read from the
gate's thread, and a connection counted can stop being closable (its reader caught up)
before the head is admitted. The front then closed its address's oldest request waiting
for a render turn, unanswered (a reset), or refused the head with a 503: the
`closed_by_daemon: 1` of a CI run of test_connection_memory (800 scrapes from one address,
reproduced ~1 run in 8 on a loaded host). Here the gate's view of the front is made stale
on purpose, so the window is always open. Counted, not timed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvsidecar.web.server import WebServer

from .hostile import port_of

CAP = 4


# max_requests 2: two of the front render, two wait for a render turn (owed, closable at
# the cap: one was closed unanswered); 40: all four render (nothing closable: the head
# was refused with a 503).
@pytest.fixture(params=[2, 40], ids=["turns-waiting", "all-rendering"])
def server(request: pytest.FixtureRequest) -> Iterator[WebServer]:
    def slow(request: object) -> tuple[bytes, str]:
        time.sleep(1.0)
        return b"done\n", "text/plain"

    web = WebServer(
        {"/slow": slow}, ["127.0.0.1:0"],
        max_connections=CAP, max_requests=request.param, request_timeout_s=30.0,
    )  # fmt: skip
    web.start()
    yield web
    web.shutdown()


def _request(port: int, answers: list[bytes]) -> None:
    """One /slow request on its own connection; its status line, or how it ended."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while b"done\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        answers.append(data.split(b"\r\n", 1)[0] or b"closed unanswered")
    except OSError as e:
        answers.append(repr(e).encode())


def test_a_head_the_full_front_cannot_take_waits_at_the_gate(server: WebServer) -> None:
    port = port_of(server)
    front = server._front
    assert front is not None and front.gate is not None
    answers: list[bytes] = []
    first = [threading.Thread(target=_request, args=(port, answers)) for _ in range(CAP)]
    for t in first:
        t.start()
    deadline = time.monotonic() + 30
    while len(front.open) < CAP and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(front.open) == CAP  # rendering or waiting their turn: none closable
    front.gate.front_room = lambda: 1  # the gate's stale view: room for one more
    more = [threading.Thread(target=_request, args=(port, answers)) for _ in range(2)]
    for t in more:
        t.start()
    for t in (*first, *more):
        t.join(60)
    assert sorted(answers) == [b"HTTP/1.1 200 OK"] * (CAP + 2), answers
