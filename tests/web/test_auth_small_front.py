"""Issue 43, G3 in a small front: a valid login beside a wrong-password flood that fills
every place the front has is answered 200, not refused.

With a front of 12 places full of the flood's connections, a newcomer made room by
closing a connection waiting for a bcrypt turn, and the login waiting for its turn was
the one closed (answered 429), over and over: the flood reconnects faster than a check
runs (7 of 24 logins answered 200). Each client that matters (never checked, logged in
before, once wrong) logs in beside the flood from 1 address and from 48. Counted, not
timed: every login must be answered 200."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvsidecar.web.basic_auth import BasicAuth
from kvsidecar.web.config_file import parse_web_config
from kvsidecar.web.failures import RECENT_S
from kvsidecar.web.server import WebServer

from .hostile import metrics_server, port_of

CHECK_S = 0.05  # each check: asleep in the bcrypt thread, a stand-in for bcrypt
THREADS = 48
LOGINS = 4
CLIENT = "127.0.6.1"


@pytest.fixture
def small_front(monkeypatch: pytest.MonkeyPatch) -> Iterator[WebServer]:
    def check(self: BasicAuth, user: str, password: str) -> bool:
        time.sleep(CHECK_S)
        return password.startswith("right")

    monkeypatch.setattr(BasicAuth, "verify", check)
    cfg = parse_web_config("basic_auth_users:\n  scraper: '$2b$04$" + "a" * 53 + "'\n")
    with metrics_server(web_config=cfg, max_connections=12) as web:
        yield web


def _ask(port: int, source: str, password: str) -> bytes:
    """The answer's status line; b"" when closed unanswered (or reset)."""
    token = base64.b64encode(f"scraper:{password}".encode()).decode()
    try:
        with socket.create_connection(("127.0.0.1", port), 60, (source, 0)) as s:
            s.sendall(
                f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                f"Authorization: Basic {token}\r\n\r\n".encode()
            )
            return s.recv(4096).split(b"\r\n", 1)[0]
    except OSError:
        return b""


def _flood(port: int, source: str, k: int, stop: threading.Event) -> None:
    """Distinct wrong passwords, a new connection each, retried at once."""
    n = 0
    while not stop.is_set():
        n += 1
        if not _ask(port, source, f"wrong-{k}-{n}"):
            stop.wait(0.02)


@pytest.mark.parametrize("addresses", [1, THREADS])
@pytest.mark.parametrize("who", ["never-checked", "known", "once-wrong"])
def test_login_answered_in_a_full_front(small_front: WebServer, who: str, addresses: int) -> None:
    port = port_of(small_front)
    if who == "known":
        assert _ask(port, CLIENT, "right-before") == b"HTTP/1.1 200 OK"
    elif who == "once-wrong":
        assert _ask(port, CLIENT, "wrong-before").startswith(b"HTTP/1.1 401")
        time.sleep(RECENT_S + 0.5)  # the wrong password is no longer "just now"
    stop = threading.Event()
    threads = [
        threading.Thread(target=_flood, args=(port, f"127.0.4.{k % addresses + 1}", k, stop))
        for k in range(THREADS)
    ]
    for t in threads:
        t.start()
    try:
        stop.wait(2.0)  # every place of the front taken, refused, retaken
        statuses = [_ask(port, CLIENT, f"right-{i}") for i in range(LOGINS)]
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert small_front.stats.snapshot().rejected_connections > 0  # the front was full
    assert statuses == [b"HTTP/1.1 200 OK"] * LOGINS
