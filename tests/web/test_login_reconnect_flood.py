"""A valid login is not queued behind wrong ones from reconnecting addresses (issue 31
defect 7): 64 addresses each sending a distinct wrong password on a new connection every
time were never "suspect" (that was per connection), so a login took its round-robin turn
among 64 addresses: 64 bcrypt checks' worth (4-8 s on the issue's host).

Compared, not timed absolutely: the login under the flood against one check without it."""

from __future__ import annotations

import base64
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import bcrypt
import pytest

from kvsidecar.web.config_file import parse_web_config
from kvsidecar.web.server import WebServer

from .hostile import attackers, port_of

ADDRESSES = 64


@pytest.fixture
def server() -> Iterator[WebServer]:
    cost = bcrypt.gensalt(10)
    users = {f"u{i}": bcrypt.hashpw(f"pw{i}".encode(), cost).decode() for i in range(8)}
    cfg = parse_web_config(
        "basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in users.items())
    )
    web = WebServer(
        {"/metrics": lambda request: (b"up 1\n", "text/plain; version=0.0.4")},
        ["127.0.0.1:0"],
        web_config=cfg,
        request_timeout_s=30.0,
    )
    web.start()
    yield web
    web.shutdown()


def _get(port: int, auth: str, source: str = "127.0.0.1", timeout: float = 30.0) -> bytes:
    token = base64.b64encode(auth.encode()).decode()
    with socket.create_connection(
        ("127.0.0.1", port), timeout=timeout, source_address=(source, 0)
    ) as s:
        s.sendall(
            f"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Authorization: Basic {token}\r\n\r\n".encode()
        )
        return s.recv(64)


def _login_time(port: int, i: int, source: str = "127.0.0.1") -> float:
    t0 = time.monotonic()
    assert _get(port, f"u{i}:pw{i}", source).startswith(b"HTTP/1.1 200")
    return time.monotonic() - t0


def _flood(port: int, k: int, stop: threading.Event, sent: list[int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        sent[k] += 1  # sent: its answer may wait behind the logins now
        try:
            _get(port, f"u0:wrong-{k}-{n}", source=f"127.0.2.{k + 1}")
        except OSError:
            time.sleep(0.02)


def test_login_not_queued_behind_reconnecting_wrong_passwords(server: WebServer) -> None:
    port = port_of(server)
    baseline = statistics.median(_login_time(port, i) for i in (5, 6, 7))  # one check each
    sent = [0] * ADDRESSES
    with attackers(lambda k, stop: _flood(port, k, stop, sent), ADDRESSES):
        time.sleep(3.0)  # every address has failed once and keeps a check queued
        took = [_login_time(port, i) for i in (1, 2, 3)]  # uncached users
        assert sum(1 for c in sent if c) >= ADDRESSES // 2, "the flood did not run"
    print(f"logins {[round(t, 2) for t in took]} s, baseline {baseline:.2f} s")  # for -rP
    # Round-robin among 64 addresses is ~64 checks; a login ahead of the suspects waits
    # for the check in progress and its own. 16 checks' worth tells them apart on a
    # loaded host.
    assert statistics.median(took) < 16 * baseline, (
        f"logins took {[round(t, 2) for t in took]} s under the flood, {baseline:.2f} s without"
    )


def test_login_from_a_new_address_not_queued_behind_first_checks(server: WebServer) -> None:
    """The flood's addresses all begin at once, each with a first check that is not yet
    suspect; a login from an address never checked before goes ahead of them (the newest
    address first), instead of waiting a round of 64 checks."""
    port = port_of(server)
    baseline = statistics.median(
        _login_time(port, i, source="127.0.3.1") for i in (5, 6, 7)
    )  # one check each, from an address the login below does not use
    sent = [0] * ADDRESSES
    with attackers(lambda k, stop: _flood(port, k, stop, sent), ADDRESSES):
        time.sleep(1.0)  # every address has its first check queued
        took = _login_time(port, 1)  # from 127.0.0.1, never checked
        assert sum(1 for c in sent if c) >= ADDRESSES // 2, "the flood did not run"
    print(f"login {took:.2f} s, baseline {baseline:.2f} s")  # for -rP
    assert took < 16 * baseline, f"login: {took:.2f} s under the flood, {baseline:.2f} s without"
