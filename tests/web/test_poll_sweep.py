"""The gateway listener sweeps its connections' deadlines when one is due, not on a clock
(issue 44 item 1): kept-alive pickers polled far from any deadline wake no sweep (and, on
the compiled path, no Python at all), while a silent head, a silent newcomer and an idle
connection are still closed for what they are. Counted as work (sweeps, returns of the
compiled wait), never timed. Real sockets against a real `PollServer`.
"""

from __future__ import annotations

import socket
import time

import pytest

from kvsidecar.bench.gateway_floor import constant_route
from kvsidecar.web import poll_server
from kvsidecar.web.poll_server import PollServer
from tests.support.procs import wait_for

HEAD = b"GET /metrics HTTP/1.1\r\nHost: picker\r\n\r\n"
PATHS = [
    pytest.param(
        True,
        id="compiled",
        marks=pytest.mark.skipif(not poll_server.FAST, reason="extension not built"),
    ),
    pytest.param(False, id="python"),
]


def counted(server: PollServer, name: str) -> list[int]:
    """Count calls of the server's method `name` (on its own thread)."""
    calls = [0]
    method = getattr(server, name)

    def wrapper(*args):
        calls[0] += 1
        return method(*args)

    setattr(server, name, wrapper)
    return calls


def poll(s: socket.socket) -> None:
    s.sendall(HEAD)
    got = b""
    while not got.endswith(b"floor 1.0\n"):
        chunk = s.recv(4096)
        assert chunk, "closed mid-poll"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


@pytest.mark.parametrize("compiled", PATHS)
def test_polls_far_from_any_deadline_wake_no_sweep(compiled: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    server = PollServer([(listener, constant_route())], compiled=compiled)
    sweeps = counted(server, "_sweep")
    waits = counted(server, "_wait_fast")
    server.start()
    conns = [connect(listener.getsockname()[1]) for _ in range(8)]
    try:
        for s in conns:
            poll(s)  # each served once: its next deadline is idle_timeout (60 s) away
        fast0, sweeps0, waits0, t0 = server.fast_polls, sweeps[0], waits[0], time.monotonic()
        rounds = 40
        for _ in range(rounds):  # 20 rounds a second: 8 sweeps a second's worth on main
            for s in conns:
                poll(s)
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        swept = sweeps[0] - sweeps0
        # A sweep every 0.25 s before: >= 8 in these >= 2 s. Now none is due but the one
        # the newcomers' first-byte deadline (2 s after their accept) asked for, and the
        # upper bound (one each 5 s, however long this took on a loaded host).
        assert swept <= 1 + elapsed / 5.0, (swept, elapsed)
        if compiled:
            # Every poll served in C, and the compiled wait came back to Python only for
            # those sweeps (and the loop's first turn after the warm-up).
            assert server.fast_polls - fast0 == rounds * len(conns)
            assert waits[0] - waits0 <= swept + 2, (waits[0] - waits0, swept)
        assert server.closed == {}
    finally:
        for s in conns:
            s.close()
        server.shutdown()


@pytest.fixture
def no_periodic_sweep(monkeypatch):
    """The sweeps' upper bound out of reach: a deadline is met because it was computed,
    never because a periodic sweep happened to come by."""
    monkeypatch.setattr(poll_server, "_SWEEP", 3600.0)


@pytest.mark.parametrize("compiled", PATHS)
def test_silent_heads_newcomers_and_idle_connections_still_closed(
    compiled: bool, no_periodic_sweep
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    server = PollServer(
        [(listener, constant_route())], head_timeout=0.5, idle_timeout=1.5, compiled=compiled
    )
    sweeps = counted(server, "_sweep")
    server.start()
    port = listener.getsockname()[1]
    mid_head, silent, idle, busy = (connect(port) for _ in range(4))
    try:
        for s in (mid_head, idle, busy):
            poll(s)
        mid_head.sendall(HEAD[:10])  # then nothing: slow_head, head_timeout after this
        # `busy` keeps polling for longer than idle_timeout: its deadline moves with each
        # poll (served in C where built), so it is never closed while the others are.
        for _ in range(25):
            poll(busy)
            time.sleep(0.1)
        assert wait_for(lambda: server.closed == {"slow_head": 2, "idle": 1})
        for s in (mid_head, silent, idle):
            s.settimeout(30)
            assert s.recv(1) == b""  # closed by the server
        poll(busy)
        assert server.connections == 1
        assert sweeps[0] >= 2
    finally:
        for s in (mid_head, silent, idle, busy):
            s.close()
        server.shutdown()


def test_a_reader_that_stops_taking_its_answer_is_still_closed(no_periodic_sweep) -> None:
    """slow_reader: an answer the client stops taking (more than the kernel's buffers
    hold), head_timeout after it was left waiting; only the Python path sends it."""
    big = (200, b"x" * (16 << 20), "text/plain", b"")
    listener = socket.create_server(("127.0.0.1", 0))
    server = PollServer([(listener, lambda path: big)], head_timeout=0.5)
    server.start()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    try:
        s.connect(listener.getsockname())
        s.sendall(HEAD)  # and never read
        assert wait_for(lambda: server.closed == {"slow_reader": 1})
        assert server.connections == 0
    finally:
        s.close()
        server.shutdown()
