"""The same-address auth flood (issue 24 item 3): distinct wrong passwords, each on a
fresh connection from the scraper's own address, so none is known to have failed. On
0704fc0 a first login queued behind every one of them (11.5-24.9 s in the audit). Now
a check waits at most `AUTH_WAIT_S` for its turn, then 429: the login is never queued
behind more checks than fit in that time. Counts, not wall-clock: the bcrypt checks the
server's own verify ran before the login was answered."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Callable

import pytest

from kvsidecar.daemon.endpoints import WebServer
from kvsidecar.web import basic_auth
from kvsidecar.web.basic_auth import PER_ADDRESS, AuthGate, BasicAuth
from kvsidecar.web.config_file import parse_web_config
from tests.web.test_server import FakeHandlers, handlers, port_of, serve  # noqa: F401

FLOOD = 100
WAIT_S = 1.0  # the deadline, lowered from 8 s to keep the test short
CHECK_S = 0.05  # each check: asleep in the bcrypt thread, so ~20 fit in WAIT_S


def _send(port: int, auth: str) -> socket.socket:
    token = base64.b64encode(auth.encode()).decode()
    s = socket.create_connection(("127.0.0.1", port), 30)
    s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())
    return s


def test_login_waits_for_no_more_checks_than_fit_in_the_deadline(
    serve: Callable[..., WebServer],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []

    def check(self: BasicAuth, user: str, password: str) -> bool:
        order.append(password)
        time.sleep(CHECK_S)  # a stand-in for bcrypt: the count is what is asserted
        return (user, password) == ("scraper", "right")

    monkeypatch.setattr(BasicAuth, "verify", check)
    monkeypatch.setattr(basic_auth, "AUTH_WAIT_S", WAIT_S, raising=False)
    cfg = parse_web_config("basic_auth_users:\n  scraper: '$2b$04$" + "a" * 53 + "'\n")
    server = serve(web_config=cfg, request_timeout_s=30.0)
    port = port_of(server)
    flood = [_send(port, f"scraper:wrong{i}") for i in range(FLOOD)]
    login = _send(port, "scraper:right")  # the scraper, from the same address, after them
    reply = login.recv(4096)
    # The checks run before the login's own, or before it was answered without one.
    ahead = order.index("right") if "right" in order else len(order)
    for s in [*flood, login]:
        s.close()
    # 0704fc0: all 100 ran first (FIFO, no deadline). Now the login is answered once its
    # deadline passes: at most WAIT_S / CHECK_S checks fit before it. Load only makes
    # each check slower (fewer fit); x2 + 2 absorbs a late timer on a loaded loop.
    bound = 2 * WAIT_S / CHECK_S + 2
    assert ahead <= bound, f"{ahead} checks ran before the login was answered ({reply[:12]!r})"
    if reply.startswith(b"HTTP/1.1 429"):
        assert b"\r\nRetry-After: 1\r\n" in reply, reply  # told when to come back
    else:
        assert reply.startswith(b"HTTP/1.1 200"), reply


def test_one_address_cannot_fill_the_queue_for_others() -> None:
    """600 checks from connections of one address that already failed (the keep-alive
    flood) take neither another address's turn nor that address's own first attempts':
    on 0704fc0 they filled the 512-deep queue and both were refused."""
    order: list[str] = []
    results: dict[str, bool | None] = {}
    release = threading.Event()

    def job(name: str) -> bool:
        release.wait(10)
        order.append(name)
        return False

    async def main() -> None:
        gate = AuthGate(workers=1)
        try:
            tasks = {}

            def submit(name: str, key: str, suspect: bool) -> None:
                tasks[name] = asyncio.create_task(gate.run(key, lambda: job(name), suspect))

            for i in range(600):
                submit(f"a{i}", "10.0.0.1", True)
                await asyncio.sleep(0)  # queued in this order
            # Those beyond the address's places are refused once they looked again.
            await asyncio.wait(list(tasks.values())[PER_ADDRESS:], timeout=5)
            submit("other", "10.0.0.2", False)
            submit("scraper", "10.0.0.1", False)
            await asyncio.sleep(0)
            release.set()
            done = await asyncio.wait_for(asyncio.gather(*tasks.values()), 30)
            results.update(zip(tasks, done, strict=True))
        finally:
            gate.close()

    asyncio.run(main())
    assert results["other"] is False and results["scraper"] is False, "refused: queue full"
    assert order.index("other") <= 2 and order.index("scraper") <= 2, order[:5]
    ran = sum(1 for name in order if name.startswith("a"))
    assert ran <= PER_ADDRESS, f"{ran} checks of failed connections from one address"
