"""The gateway listener protects its one client (issue 44 item 4): the main port's request
grammar, every pipelined poll answered, a flood from other addresses never costing a
picker a poll, a usage always in [0, 1], and a poll's work bounded whatever the directory
holds. Real sockets against a real `PollServer`; real segments for the gateway's reads.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.daemon import gateway as gw_mod
from kvsidecar.daemon import gateway_body as gb
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.gateway import Gateway
from kvsidecar.daemon.target import Target
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.schema import KVCachePoolSnapshot
from kvsidecar.protocol.writer import SegmentWriter
from kvsidecar.web.gate import _lines
from kvsidecar.web.poll_server import PollServer
from kvsidecar.web.request import BadRequest, parse_head
from tests.daemon import gateway_writer as gw
from tests.support import picker
from tests.support.procs import wait_for

BODY = b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3.0\n" * 10
ANSWER = (200, BODY, gb.CONTENT_TYPE, b"Kvsidecar-Step: 7\r\n")


def fixed(path: str) -> tuple[int, bytes, str, bytes]:
    if path != "/metrics":
        return 404, b"not found\n", "text/plain", b""
    return ANSWER  # the same tuple each time, as the gateway hands back an unchanged step


@pytest.fixture
def server():
    sock = socket.create_server(("127.0.0.1", 0))
    srv = PollServer([(sock, fixed)], max_connections=32)
    srv.start()
    try:
        yield srv, sock.getsockname()[1]
    finally:
        srv.shutdown()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(30)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def responses(s: socket.socket, n: int) -> list[int]:
    """Read up to n responses off a raw socket: their statuses (fewer if it closes)."""
    f = s.makefile("rb")
    statuses = []
    try:
        for _ in range(n):
            line = f.readline()
            if not line:
                break
            statuses.append(int(line.split()[1]))
            length = 0
            while (header := f.readline()) not in (b"\r\n", b""):
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            f.read(length)
    except OSError:
        pass
    finally:
        f.close()
    return statuses


# -- the main port's grammar ----------------------------------------------------------------

HEADS = [
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length : 31\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.7\r\nHost: x\r\n\r\n",
    b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n",
    b"GET /met rics HTTP/1.1\r\nHost: x\r\n\r\n",
    b"G(T /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\n\r\n",
    b"GET /metrics HTTP/1.1\nHost: x\n\n",
    b"GET http://x/metrics HTTP/1.1\r\nHost: x\r\n\r\n",
]


def main_port_status(head: bytes) -> int:
    try:
        parse_head(_lines(head))
    except BadRequest as e:
        return e.status
    return 200


@pytest.mark.parametrize("head", HEADS, ids=range(len(HEADS)))
def test_every_head_gets_the_main_ports_verdict(server, head):
    """The main port's parser decides: `Content-Length : 31` (its body was served as a
    second request), a NUL in a header, no Host were answered 200 here."""
    _, port = server
    s = connect(port)
    try:
        # A body after a head the parser refuses must never be answered as a request.
        s.sendall(head + b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        got = responses(s, 2)
    finally:
        s.close()
    want = main_port_status(head)
    assert got[0] == want, (head, got)
    if want != 200:
        assert got == [want], f"the connection went on after a {want}: {got}"


# -- pipelining ------------------------------------------------------------------------------


def test_two_hundred_pipelined_polls_are_all_answered(server):
    _, port = server
    s = connect(port)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
        got = responses(s, 200)
    finally:
        s.close()
    assert got == [200] * 200, f"{len(got)} of 200 answered"


def test_pipelined_polls_sent_then_half_closed_are_all_answered(server):
    _, port = server
    s = connect(port)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
        s.shutdown(socket.SHUT_WR)
        got = responses(s, 51)
    finally:
        s.close()
    assert got == [200] * 50, f"{len(got)} of 50 answered"


# -- a flood from other addresses --------------------------------------------------------------


def picker_polls(conns: list[http.client.HTTPConnection]) -> int:
    """One poll on each kept-alive connection, no redial: how many were answered 200."""
    ok = 0
    for c in conns:
        try:
            c.request("GET", "/metrics")
            r = c.getresponse()
            r.read()
            ok += r.status == 200
        except (OSError, http.client.HTTPException):
            pass
    return ok


def test_an_idle_connection_flood_from_other_addresses_costs_the_picker_no_poll(server):
    """The picker's 8 kept-alive connections are idle longer than any flood connection:
    at the cap (32), a newcomer took the place of the one idle longest, the picker's."""
    srv, port = server
    conns = [
        http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=("127.0.0.1", 0))
        for _ in range(8)
    ]
    flood: list[socket.socket] = []
    try:
        assert picker_polls(conns) == 8
        for i in range(200):  # many times the cap, from addresses that are not the picker's
            flood.append(connect(port, f"127.0.0.{2 + i % 50}"))
        assert wait_for(lambda: srv.closed.get("evicted", 0) >= 200 - 32 + 8, timeout=60)
        answered = sum(picker_polls(conns) for _ in range(5))
        assert answered == 40, f"the picker got {answered} of 40 polls answered"
    finally:
        for c in conns:
            c.close()
        for s in flood:
            s.close()


def test_pipelining_clients_cost_the_picker_no_poll(server):
    """16 clients from other addresses pipelining as fast as they are answered, beside a
    picker: every one of the picker's polls is answered, and every pipelined poll too."""
    _, port = server
    stop = threading.Event()
    answered = [0] * 16

    def pipeline(i: int) -> None:
        s = connect(port, f"127.0.0.{2 + i}")
        try:
            while not stop.is_set():
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 64)
                answered[i] += len(responses(s, 64))
        except OSError:
            pass
        finally:
            s.close()

    threads = [threading.Thread(target=pipeline, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(4)]
    try:
        got = sum(picker_polls(conns) for _ in range(25))
        assert got == 100, f"the picker got {got} of 100 polls answered"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for c in conns:
            c.close()
    assert all(a > 0 and a % 64 == 0 for a in answered), answered  # theirs whole, too


# -- the body in the protocol's range ----------------------------------------------------------

blocks = st.integers(min_value=0, max_value=2**40)


@settings(max_examples=300, deadline=None)
@given(
    engine=st.sampled_from(["vllm", "sglang", "atom", "kvsidecar-demo"]),
    total=st.integers(min_value=1, max_value=2**40),
    allocated=blocks,
    available=st.one_of(st.none(), blocks),
)
def test_usage_is_in_the_protocols_range_whatever_the_fields_say(
    engine, total, allocated, available
):
    snap = gw.build(engine, 0, "both", 5)
    pool = snap.pools[0]
    fields = {f: getattr(pool, f) for f in pool.__struct_fields__}
    fields.update(total_blocks=total, allocated_blocks=allocated, available_blocks=available)
    snap.pools[0] = KVCachePoolSnapshot(**fields)
    names = "vllm" if engine == "kvsidecar-demo" else engine  # served in vLLM's names
    usage = picker.extract(gb.render(snap, 0).decode(), names)["usage"]
    assert 0.0 <= usage <= 1.0, (total, allocated, available, usage)
    # The field the engine's own formula reads: vLLM's free queue, else the allocation.
    used_field = available if names == "vllm" and available is not None else allocated
    if used_field > total:
        assert usage == 1.0  # numbers that cannot be true are never the lowest usage


# -- a poll's work bounded whatever the directory holds ----------------------------------------


def test_sixty_four_segments_claiming_one_rank_cost_a_poll_at_most_one_read(tmp_path, monkeypatch):
    """Each poll read all 64 segments (0.4 of a core at 228 polls/s); counted as work:
    segment reads (`Target.poll` calls) per gateway poll, not time."""
    shm = str(tmp_path)
    os.chmod(shm, 0o750)
    writers = [SegmentWriter(f"kvsidecar.gw.r{i}", shm_dir=shm) for i in range(64)]
    for w in writers:
        w.publish(gw.build("vllm", 0, "both", 1))
    targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=30))
    reads = [0]
    poll = Target.poll

    def counted(self, *a, **k):
        reads[0] += 1
        return poll(self, *a, **k)

    try:
        targets.poll_all()
        assert sum(t.view.up for t in targets.targets.values()) == 64
        gateway = Gateway(targets)
        monkeypatch.setattr(Target, "poll", counted)
        for _ in range(50):
            status, body, _, _ = gateway.answer(0)
            assert status == 503 and b"all claim dp_rank 0" in body, body
        assert reads[0] <= 50, f"{reads[0]} segment reads for 50 polls"
    finally:
        targets.stop()
        for w in writers:
            w.close()


def test_an_unchanged_step_costs_one_word_and_a_new_one_is_served_at_once(tmp_path, monkeypatch):
    """Counted as work: polls of an unchanged step read no segment (the published sequence
    word alone); the poll after a publish reads it and serves the new step, whatever the
    window left (here an hour, so no clock decides)."""
    monkeypatch.setattr(gw_mod, "FULL_CHECK_EVERY", 3600.0)
    shm = str(tmp_path)
    os.chmod(shm, 0o750)
    writer = SegmentWriter("kvsidecar.gw.dp0", shm_dir=shm)
    targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=30))
    try:
        writer.publish(gw.build("vllm", 0, "both", 1))
        targets.poll_all()  # no background poller: the poll cycle (version) stays
        gateway = Gateway(targets, stale_after=3600.0)
        first = gateway.answer(0)
        assert first[0] == 200 and first[3] == b"Kvsidecar-Step: 1\r\n", first
        for _ in range(100):
            assert gateway.answer(0) is first  # the same tuple: its bytes re-sent as built
        assert (gateway.full_checks, gateway.segment_reads) == (1, 1)
        for step in (2, 3):
            writer.publish(gw.build("vllm", 0, "both", step))
            status, body, _, extra = gateway.answer(0)
            assert status == 200 and extra == b"Kvsidecar-Step: %d\r\n" % step
            assert picker.extract(body.decode(), "vllm") == gw.expected("vllm", step)
        assert gateway.full_checks == 3
        assert gateway.counts()[(0, "ok")] == 103  # every poll counted, the cheap ones too
    finally:
        targets.stop()
        writer.close()
