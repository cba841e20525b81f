"""The gate (issue 31 item 1): connections without a whole request head are parked at no
cost to the front, and the cap's victim is chosen by progress and age.

In-process `WebServer`s; counted, not timed (each wait is generous)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from kvsidecar.web.gate import FRESH_GRACE_S, PARKED_BYTES
from kvsidecar.web.server import WebServer

from .hostile import answered_probes, port_of


def _metrics() -> tuple[bytes, str]:
    return b"up 1\n", "text/plain; version=0.0.4"


@pytest.fixture
def small_front() -> Iterator[WebServer]:
    """A front of 8 places and a gate of 64 parked connections."""
    web = WebServer(
        {"/metrics": lambda request: _metrics()},
        ["127.0.0.1:0"],
        max_connections=8,
        request_timeout_s=30.0,
        parked_memory=64 * PARKED_BYTES,
        # The gate's own choices for silent connections that reach it: at once here, not
        # after the kernel's defer period (test_gate_defer.py), nor after a first byte.
        defer_accept_s=0,
    )
    web.start()
    yield web
    web.shutdown()


def _open(port: int, stack: ExitStack, first: bytes = b"") -> socket.socket:
    s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
    if first:
        s.sendall(first)
    return s


def _closed_by_server(s: socket.socket, wait_s: float = 0.0) -> bool:
    s.settimeout(wait_s or None)
    s.setblocking(wait_s > 0)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, TimeoutError):
        return False
    except OSError:
        return True


def test_half_sent_heads_beyond_the_front_cap_are_parked_not_evicted(
    small_front: WebServer,
) -> None:
    """48 clients each holding half a request line: six times the front's 8 places, none
    closed, probes and a scrape answered, no connection rejected. Before the gate, the
    front closed 40 of them (its cap) and each reconnect closed another."""
    port = port_of(small_front)
    with ExitStack() as stack:
        held = [_open(port, stack, b"GET /met") for _ in range(48)]
        time.sleep(FRESH_GRACE_S + 0.5)
        assert answered_probes(port, 10) == 10
        scrape = _open(port, stack, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert scrape.recv(64).startswith(b"HTTP/1.1 200")
        assert not any(_closed_by_server(s) for s in held)
    assert small_front.stats.snapshot().rejected_connections == 0


def test_at_the_gate_cap_the_connection_silent_longest_goes(small_front: WebServer) -> None:
    """64 parked (the gate's cap): 63 silent and one that keeps sending a byte. Newcomers
    close silent ones, oldest first, never the one making progress nor themselves."""
    port = port_of(small_front)
    with ExitStack() as stack:
        silent = [_open(port, stack) for _ in range(63)]
        trickler = _open(port, stack, b"G")
        time.sleep(FRESH_GRACE_S + 0.5)
        trickler.sendall(b"E")  # progress: to the young end of the victim order
        time.sleep(0.2)
        newcomers = [_open(port, stack, b"GET /metrics HTTP/1.1\r\n") for _ in range(4)]
        assert [_closed_by_server(s, 5.0) for s in silent[:4]] == [True] * 4
        assert not any(_closed_by_server(s) for s in silent[4:])
        assert not _closed_by_server(trickler)
        assert not any(_closed_by_server(s) for s in newcomers)
        assert answered_probes(port, 5) == 5  # a probe closes one more silent, and is answered
    assert small_front.stats.snapshot().rejected_connections >= 4
