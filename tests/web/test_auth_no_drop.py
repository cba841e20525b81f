"""Issue 43 item 3: a request that presented credentials is answered or refused with a
status (429/503 with Retry-After), never closed unanswered to make room.

Under a wrong-password flood from many addresses holding connections in every tier
(waiting for a bcrypt turn, sitting out a wrong password's pause, idle), the front closed
connections waiting for a bcrypt turn at its cap, the valid login among them (curl: empty
reply). Counted, not timed: every login gets a status line."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator

import bcrypt
import pytest

from kvsidecar.web.config_file import parse_web_config
from kvsidecar.web.server import WebServer

from .hostile import port_of

USERS = 12
ADDRESSES = 48


@pytest.fixture
def small_front() -> Iterator[WebServer]:
    cost = bcrypt.gensalt(10)
    users = {f"u{i}": bcrypt.hashpw(f"pw{i}".encode(), cost).decode() for i in range(USERS)}
    cfg = parse_web_config(
        "basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in users.items())
    )
    web = WebServer(
        {"/metrics": lambda request: (b"up 1\n", "text/plain; version=0.0.4")},
        ["0.0.0.0:0"],
        web_config=cfg,
        max_connections=12,
        request_timeout_s=30.0,
    )
    web.start()
    yield web
    web.shutdown()


def _request(auth: str, close: bool = True) -> bytes:
    token = base64.b64encode(auth.encode()).decode()
    connection = "Connection: close\r\n" if close else ""
    return (
        f"GET /metrics HTTP/1.1\r\nHost: x\r\n{connection}Authorization: Basic {token}\r\n\r\n"
    ).encode()


def _answer(port: int, source: str, payload: bytes, timeout: float = 60.0) -> bytes:
    """The first bytes of the answer; b"" when closed unanswered (or reset)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout, (source, 0)) as s:
            s.sendall(payload)
            return s.recv(4096)
    except OSError:
        return b""


def _flood(port: int, k: int, stop: threading.Event) -> None:
    """Attacker k: a kept-alive connection re-sending wrong passwords, a new connection per
    distinct wrong password, and an idle one, all from its own address."""
    source = f"127.0.4.{k + 1}"
    n = 0
    idle: socket.socket | None = None
    while not stop.is_set():
        n += 1
        try:
            if idle is None:
                idle = socket.create_connection(("127.0.0.1", port), 10, (source, 0))
            with socket.create_connection(("127.0.0.1", port), 10, (source, 0)) as s:
                for i in range(3):
                    s.sendall(_request(f"u0:wrong-{k}-{n}-{i}", close=i == 2))
                    if not s.recv(4096):
                        break
        except OSError:
            if idle is not None:
                idle.close()
            idle = None
            stop.wait(0.02)
    if idle is not None:
        idle.close()


def test_logins_answered_with_a_status_under_a_flood_at_the_cap(small_front: WebServer) -> None:
    """48 addresses' wrong passwords against a front of 12 places: each of 12 uncached valid
    logins is answered 200 or refused 429/503 with Retry-After, none closed unanswered."""
    port = port_of(small_front)
    stop = threading.Event()
    threads = [threading.Thread(target=_flood, args=(port, k, stop)) for k in range(ADDRESSES)]
    for t in threads:
        t.start()
    try:
        stop.wait(2.0)
        answers = [_answer(port, "127.0.0.1", _request(f"u{i}:pw{i}")) for i in range(USERS)]
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert small_front.stats.snapshot().rejected_connections > 0  # the cap was reached
    dropped = [a for a in answers if not a.startswith(b"HTTP/1.1 ")]
    assert dropped == []
    for a in answers:
        assert a.startswith(b"HTTP/1.1 200") or (
            a.split(b" ")[1] in (b"429", b"503") and b"Retry-After:" in a
        ), a
