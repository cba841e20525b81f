"""Busy connections cannot fill the connection cap (issue 31 defect 3): addresses that each
hold one connection re-sending distinct wrong passwords (every one a bcrypt check, queued)
left nothing evictable at the cap, and every probe from another address was refused.

Counted, not timed: the share of `/-/healthy` probes answered within a generous timeout."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Iterator

import bcrypt
import pytest

from kvsidecar.web.config_file import parse_web_config
from kvsidecar.web.server import WebServer

from .hostile import answered_probes, attackers, port_of

ATTACKERS = 40  # one connection each, from its own loopback address
CAP = 24
PROBES = 20


def _metrics() -> tuple[bytes, str]:
    return b"up 1\n", "text/plain; version=0.0.4"


@pytest.fixture
def server() -> Iterator[WebServer]:
    pw_hash = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(10)).decode()
    cfg = parse_web_config(f"basic_auth_users: {{alice: '{pw_hash}'}}")
    web = WebServer(
        {"/metrics": lambda request: _metrics()},
        ["127.0.0.1:0"],
        web_config=cfg,
        max_connections=CAP,
        request_timeout_s=5.0,
    )
    web.start()
    yield web
    web.shutdown()


def _attack(port: int, k: int, stop: threading.Event, sent: list[int]) -> None:
    """One keep-alive connection from 127.0.1.k re-sending a new wrong password at once."""
    n = 0
    while not stop.is_set():
        try:
            with socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=(f"127.0.1.{k + 1}", 0)
            ) as s:
                while not stop.is_set():
                    n += 1
                    token = base64.b64encode(f"alice:wrong-{k}-{n}".encode()).decode()
                    s.sendall(
                        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}"
                        "\r\n\r\n".encode()
                    )
                    sent[k] += 1
                    if not s.recv(4096):
                        break
        except OSError:
            time.sleep(0.05)


def test_probes_answered_while_busy_wrong_logins_hold_the_cap(server: WebServer) -> None:
    port = port_of(server)
    sent = [0] * ATTACKERS
    with attackers(lambda k, stop: _attack(port, k, stop, sent), ATTACKERS):
        time.sleep(1.5)  # every attacker connected, its check queued
        answered = answered_probes(port, PROBES)
        assert sum(sent) >= CAP, "the flood did not run"
    print(f"answered {answered}/{PROBES}")  # the figure, for -rP
    # Before the fix nearly every probe was refused (2/43 in the issue); the goal is 95 %.
    assert answered >= PROBES * 0.9, f"{answered}/{PROBES} probes answered"
