"""Issue 43 item 4: one past wrong password does not put an address behind a flood.

An address that sent one wrong password (a Prometheus during a credential rotation) was
remembered as failed, and its next login waited until no other check did: behind every
flooding address (4.2-8 s or 429 behind 64). Each client that matters (never checked,
logged in before, once wrong) logs in beside 1 and 64 flooding addresses. Counts, not
wall-clock: the bcrypt checks the server ran between the login's arrival and its own."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Callable

import pytest

from kvsidecar.daemon.endpoints import WebServer
from kvsidecar.web.basic_auth import BasicAuth
from kvsidecar.web.config_file import parse_web_config
from kvsidecar.web.failures import RECENT_S
from tests.web.test_server import FakeHandlers, handlers, port_of, serve  # noqa: F401

CHECK_S = 0.05  # each check: asleep in the bcrypt thread, a stand-in for bcrypt
AHEAD = 6  # the check running, and a few flood checks that arrived with the login


def _ask(port: int, source: str, password: str) -> bytes:
    token = base64.b64encode(f"scraper:{password}".encode()).decode()
    with socket.create_connection(("127.0.0.1", port), 60, (source, 0)) as s:
        s.sendall(
            f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Authorization: Basic {token}\r\n\r\n".encode()
        )
        return s.recv(64)


def _flood(port: int, k: int, stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        try:
            _ask(port, f"127.0.5.{k + 1}", f"wrong-{k}-{n}")
        except OSError:
            stop.wait(0.02)


@pytest.mark.parametrize("addresses", [1, 64])
@pytest.mark.parametrize("who", ["never-checked", "known", "once-wrong"])
def test_login_not_behind_the_flood(
    serve: Callable[..., WebServer],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    who: str,
    addresses: int,
) -> None:
    order: list[str] = []

    def check(self: BasicAuth, user: str, password: str) -> bool:
        order.append(password)
        time.sleep(CHECK_S)
        return password.startswith("right")

    monkeypatch.setattr(BasicAuth, "verify", check)
    cfg = parse_web_config("basic_auth_users:\n  scraper: '$2b$04$" + "a" * 53 + "'\n")
    server = serve(addresses=("0.0.0.0:0",), web_config=cfg, request_timeout_s=60.0)
    port = port_of(server)
    client = "127.0.6.1"
    if who == "known":
        assert _ask(port, client, "right-before").startswith(b"HTTP/1.1 200")
    elif who == "once-wrong":
        assert _ask(port, client, "wrong-before").startswith(b"HTTP/1.1 401")
    time.sleep(RECENT_S + 0.5)  # the wrong password is no longer "just now"
    stop = threading.Event()
    threads = [threading.Thread(target=_flood, args=(port, k, stop)) for k in range(addresses)]
    for t in threads:
        t.start()
    try:
        while len(order) < 3 * addresses + 3:  # every flooding address failed twice or more
            time.sleep(CHECK_S)
        mark = len(order)
        reply = _ask(port, client, "right")
        ahead = order.index("right", mark) - mark if "right" in order[mark:] else len(order)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    assert ahead <= AHEAD, f"{ahead} checks ran before the {who} login's own"
