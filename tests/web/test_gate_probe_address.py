"""Issue 43 item 2: a probe is answered whatever else comes from its address.

At the gate's cap, with every parked connection young (idle clients reconnecting as fast
as they are closed), the gate closed the newcomer when the flood came from the newcomer's
own address: a kubelet shares the node's address with every hostNetwork pod. Each
eviction case is tried with the client that matters on the attacker's address and on
another. In-process `WebServer`s; counted, not timed."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvsidecar.web.gate import FRESH_GRACE_S, PARKED_BYTES
from kvsidecar.web.server import WebServer
from tests.attacks.hostile_fds import IdleClients

from .hostile import port_of

PROBER = "127.0.0.1"
OTHER = "127.0.0.3"
PARKED = 64
FLOOD = 4 * PARKED  # idle clients, reopened as soon as they are closed


@pytest.fixture
def small_gate() -> Iterator[WebServer]:
    web = WebServer(
        {"/metrics": lambda request: (b"up 1\n", "text/plain; version=0.0.4")},
        ["0.0.0.0:0"],
        max_connections=8,
        request_timeout_s=30.0,
        parked_memory=PARKED * PARKED_BYTES,
    )
    web.start()
    yield web
    web.shutdown()


def _ask(port: int, source: str, path: str) -> bool:
    """One request on a new connection from ``source``: answered 200 (generous timeout)."""
    try:
        with socket.socket() as s:
            s.settimeout(10)
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


@pytest.mark.parametrize("flood_from", [PROBER, OTHER])
@pytest.mark.parametrize("path", ["/-/healthy", "/-/ready", "/metrics"])
def test_probes_answered_beside_a_reconnecting_flood(
    small_gate: WebServer, flood_from: str, path: str
) -> None:
    """256 idle clients kept reconnecting against a gate of 64: every probe and scrape
    from 127.0.0.1 is answered, the flood on its address or on another. On main, with the
    flood on the prober's address, the newcomer was closed: 0-4 of 36-39 answered."""
    port = port_of(small_gate)
    flood = IdleClients(port, FLOOD, source=flood_from).start()
    try:
        time.sleep(FRESH_GRACE_S)
        assert flood.reopened > 0  # the gate is at its cap and closing
        answered = sum(_ask(port, PROBER, path) for _ in range(20))
        assert flood.reopened > FLOOD  # still churning while we asked
    finally:
        flood.stop()
    assert answered == 20
