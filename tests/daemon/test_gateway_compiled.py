"""The gateway listener's compiled path (issue 44 item 1): a picker's polls of an unchanged
step are served by `kvsidecar.web._pollfast` with no Python-level parse, a new step by the
Python path at once, anything else (pipelined, split, other heads) handed back whole; and
without the extension every poll takes the Python path with the same answers. Counted as
work (polls served in C, heads parsed, full checks), never timed. Real sockets, a real
`PollServer`, a real segment.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys

import pytest

from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.gateway import Gateway
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.writer import SegmentWriter
from kvsidecar.web import poll_server
from tests.daemon import gateway_writer as gw
from tests.support import picker

HEAD = b"GET /metrics HTTP/1.1\r\nHost: picker\r\n\r\n"


def _read(f) -> tuple[int, bytes, bytes]:
    """One response off a socket file: (status, its Kvsidecar-Step value, body)."""
    status = int(f.readline().split()[1])
    length, step = 0, b""
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
        elif name.lower() == b"kvsidecar-step":
            step = value.strip()
    return status, step, f.read(length)


def scenario(shm: str) -> dict:
    """Polls against a gateway over one kept-alive connection, the step unchanged, then
    new; what each took, counted. Run here and in a process without the extension."""
    from kvsidecar.daemon import gateway as gw_mod

    # Counted: heads the Python path answered (each looks its verdict up) and heads parsed.
    calls = {"python": 0, "parses": 0}
    verdict, parse_head = poll_server.PollServer._verdict, poll_server.parse_head

    def looked_up(self, head):
        calls["python"] += 1
        return verdict(self, head)

    def parsed(lines):
        calls["parses"] += 1
        return parse_head(lines)

    saved = gw_mod.FULL_CHECK_EVERY
    gw_mod.FULL_CHECK_EVERY = 3600.0  # no clock decides: only a publish ends the window
    poll_server.PollServer._verdict = looked_up  # type: ignore[method-assign]
    poll_server.parse_head = parsed
    try:
        return _polls(shm, calls)
    finally:
        gw_mod.FULL_CHECK_EVERY = saved
        poll_server.PollServer._verdict = verdict  # type: ignore[method-assign]
        poll_server.parse_head = parse_head


def _polls(shm: str, calls: dict) -> dict:
    writer = SegmentWriter("kvsidecar.gw.dp0", shm_dir=shm)
    targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=30))
    writer.publish(gw.build("vllm", 0, "both", 1))
    targets.poll_all()  # no background poller: the poll cycle (version) stays
    gateway = Gateway(targets, stale_after=3600.0)
    sock = socket.create_server(("127.0.0.1", 0))
    server = poll_server.PollServer([(sock, gateway.route(0))])
    server.start()
    out: dict = {"fast": poll_server.FAST, "steps": [], "bodies_ok": True}
    s = socket.create_connection(sock.getsockname(), timeout=30)
    f = s.makefile("rb")

    def poll(data: bytes = HEAD, n: int = 1) -> None:
        s.sendall(data)
        for _ in range(n):
            status, step, body = _read(f)
            out["steps"].append((status, int(step)))
            if picker.extract(body.decode(), "vllm") != gw.expected("vllm", int(step)):
                out["bodies_ok"] = False

    try:
        for _ in range(50):
            poll()
        out["after_50"] = (server.fast_polls, *calls.values(), gateway.full_checks)
        writer.publish(gw.build("vllm", 0, "both", 2))
        poll()  # the new step: the word moved, a full check at once
        out["after_new_step"] = (server.fast_polls, *calls.values(), gateway.full_checks)
        poll()
        poll(HEAD * 3, 3)  # pipelined: handed back whole, all answered in order
        s.sendall(HEAD[:9])  # split: the first bytes are not a head, handed back
        poll(HEAD[9:])
        poll(HEAD.replace(b"picker", b"other"))  # another head: parsed once, then fast
        poll(HEAD.replace(b"picker", b"other"))
        out["end"] = (server.fast_polls, *calls.values(), gateway.full_checks)
        out["answers"] = gateway.counts()[(0, "ok")]
        out["requests"] = server.request_counts()[200]
        conns = list(server._conns.values())
    finally:
        f.close()
        s.close()
        server.shutdown()
        targets.stop()
        writer.close()
    # Read once the listener has stopped: what C served is folded into each connection
    # before its wait returns (the Python path reads it only then).
    out["served"] = [c.served for c in conns]
    return out


def _shm(tmp_path) -> str:
    shm = str(tmp_path)
    os.chmod(shm, 0o750)
    return shm


@contextlib.contextmanager
def _serving(tmp_path, **options):
    """A writer at step 1, its targets polled once, a gateway of rank 0 and a listener
    (`PollServer` options): yields (gateway, server, the listener's address)."""
    shm = _shm(tmp_path)
    writer = SegmentWriter("kvsidecar.gw.dp0", shm_dir=shm)
    targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=30))
    writer.publish(gw.build("vllm", 0, "both", 1))
    targets.poll_all()
    gateway = Gateway(targets, stale_after=3600.0)
    sock = socket.create_server(("127.0.0.1", 0))
    server = poll_server.PollServer([(sock, gateway.route(0))], **options)
    server.start()
    try:
        yield gateway, server, sock.getsockname()
    finally:
        server.shutdown()
        targets.stop()
        writer.close()


def check_answers(got: dict) -> None:
    """What a picker sees, whichever path served it: the same whatever the extension."""
    assert got["steps"] == [(200, 1)] * 50 + [(200, 2)] * 8, got["steps"]
    assert got["bodies_ok"]
    assert got["answers"] == got["requests"] == 58  # every poll counted, the fast ones too
    assert got["served"] == [58]


@pytest.mark.skipif(not poll_server.FAST, reason="kvsidecar.web._pollfast is not built")
def test_unchanged_step_polls_are_served_compiled_with_no_parse(tmp_path):
    got = scenario(_shm(tmp_path))
    check_answers(got)
    # (served in C, answered by Python, heads parsed, full checks)
    # 50 polls of one step: the first parsed and fully checked, 49 served in C.
    assert got["after_50"] == (49, 1, 1, 1)
    # A new step: the Python path, a full check, at the very next poll.
    assert got["after_new_step"] == (49, 2, 1, 2)
    # Then: one in C; pipelined (3 heads in one read) and split heads by Python (their
    # verdict kept: no new parse); another head parsed once, its next poll in C.
    assert got["end"] == (51, 7, 2, 2)


def test_without_the_extension_every_poll_takes_the_python_path(tmp_path):
    """The extension missing (its import fails, as where no compiler built it): the same
    answers and counts, every poll by the Python path."""
    code = (
        "import sys, json; sys.modules['kvsidecar.web._pollfast'] = None\n"
        "from tests.daemon import test_gateway_compiled as t\n"
        f"print(json.dumps(t.scenario({_shm(tmp_path)!r})))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    got["steps"] = [tuple(x) for x in got["steps"]]
    assert got["fast"] is False
    check_answers(got)
    assert tuple(got["end"]) == (0, 58, 2, 2)  # every poll answered by Python, the same checks


class _Wrapped(socket.socket):
    """A connection whose bytes are not the plain socket's (as a TLS socket's are not)."""


class _WrappingListener(socket.socket):
    def accept(self):
        sock, addr = super().accept()
        return _Wrapped(sock.family, sock.type, sock.proto, fileno=sock.detach()), addr


def test_a_wrapped_connection_never_takes_the_compiled_path(tmp_path):
    """The compiled path reads and writes the descriptor itself: a wrapped (TLS) socket's
    polls all take the Python path, answered as the plain socket's are."""
    shm = _shm(tmp_path)
    writer = SegmentWriter("kvsidecar.gw.dp0", shm_dir=shm)
    targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=30))
    writer.publish(gw.build("vllm", 0, "both", 1))
    targets.poll_all()
    gateway = Gateway(targets, stale_after=3600.0)
    listener = _WrappingListener(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = poll_server.PollServer([(listener, gateway.route(0))])
    server.start()
    s = socket.create_connection(listener.getsockname(), timeout=30)
    f = s.makefile("rb")
    try:
        for _ in range(20):
            s.sendall(HEAD)
            assert _read(f)[:2] == (200, b"1")
        assert [type(c.sock) for c in server._conns.values()] == [_Wrapped]
        assert server.fast_polls == 0
        assert gateway.counts()[(0, "ok")] == 20
    finally:
        f.close()
        s.close()
        server.shutdown()
        targets.stop()
        writer.close()


@pytest.mark.skipif(not poll_server.FAST, reason="kvsidecar.web._pollfast is not built")
def test_a_poll_served_in_c_touches_no_python_object(tmp_path, monkeypatch):
    """Counted as work: 100 polls of an unchanged step served in C write no attribute
    of their connection (main: `served` and `progress` each poll, a new int and float
    each time); what C served is folded into the connection when the wait returns."""
    writes: dict[str, int] = {"served": 0, "progress": 0}

    class Counted(poll_server._Conn):
        def __setattr__(self, name, value):
            if name in writes:
                writes[name] += 1
            super().__setattr__(name, value)

    monkeypatch.setattr(poll_server, "_Conn", Counted)
    with contextlib.ExitStack() as stack:
        gateway, server, address = stack.enter_context(_serving(tmp_path))
        s = stack.enter_context(socket.create_connection(address, timeout=30))
        f = stack.enter_context(s.makefile("rb"))
        for _ in range(2):  # the first answered by Python, which arms the descriptor
            s.sendall(HEAD)
            assert _read(f)[:2] == (200, b"1")
        fast0, before = server.fast_polls, dict(writes)
        for _ in range(100):
            s.sendall(HEAD)
            assert _read(f)[:2] == (200, b"1")
        assert server.fast_polls - fast0 == 100
        # At most the folds of the wait's returns (a deadline's sweep): never per poll.
        assert writes["served"] - before["served"] <= 2, writes
        assert writes["progress"] - before["progress"] <= 2, writes
        conn = next(iter(server._conns.values()))
    assert conn.served == 102  # folded: every poll counted on its connection
    assert gateway.counts()[(0, "ok")] == server.request_counts()[200] == 102


@pytest.mark.skipif(not poll_server.FAST, reason="kvsidecar.web._pollfast is not built")
def test_a_closed_connection_s_descriptor_is_disarmed_before_its_number_is_reused(tmp_path):
    """The server closes an armed connection (evicted at the connection cap): its
    descriptor is disarmed as it is closed, so a connection that gets its number next is
    never served from the closed one's entry (its head, its connection's counts)."""
    with contextlib.ExitStack() as stack:
        _, server, address = stack.enter_context(_serving(tmp_path, max_connections=1))
        first = stack.enter_context(socket.create_connection(address, timeout=30))
        f = stack.enter_context(first.makefile("rb"))
        for _ in range(3):
            first.sendall(HEAD)
            assert _read(f)[:2] == (200, b"1")
        (fd,) = server._conns
        (conn,) = server._conns.values()
        assert server.fast_polls == 2 and server._fast.armed(fd)
        second = stack.enter_context(socket.create_connection(address, timeout=30))
        g = stack.enter_context(second.makefile("rb"))
        second.sendall(HEAD)
        assert _read(g)[:2] == (200, b"1")
        assert server.closed.get("evicted") == 1 and first.recv(1) == b""
        assert fd not in server._conns and not server._fast.armed(fd)
        assert conn.served == 3  # its C-served polls folded in as it was closed
