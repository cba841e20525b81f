"""The KV-event publisher's memory has a budget of its own, whatever the table's size
(#43 item 8: a new reader kind inside the daemon's 64 MiB).

* Subscribers that connect and stop reading while a full state goes out hold at most
  the PUB's queue of it (`kv_events_zmq.PUB_QUEUE_BYTES`), not the state: measured as the
  publisher process's anonymous RSS (the queues are libzmq's and pyzmq's memory), a real
  segment, real ZMQ over loopback TCP. On main the batches were 1,024 events (about 200 KB
  at block size 16) and the queue 1,024 of them: every such subscriber held the whole state.
* The kernel's send buffers of those connections (charged to the container's cgroup too)
  are bounded (`kv_events_zmq.SOCKET_SNDBUF`); main left them to autotuning, up to 4 MiB a
  connection.
* Every batch published, live or of a full state, is at most `kv_events_state.BATCH_BYTES`
  of events unless one event alone is larger: what bounds a queue of N messages.
* Building the full state allocates at most 26 bytes a cached block beyond a constant
  (tracemalloc, the slope between two table sizes; main: 32).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tracemalloc

import msgspec
import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol.kv_events_reader import KVEventsReader
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_state
from kvsidecar.streams import kv_events_zmq as kz
from kvsidecar.streams.kv_events_wire import KVEventBatch
from tests.support.kv_chains import TOKENS, store_chains

BATCH_BYTES = 8 * 1024  # kv_events_state.BATCH_BYTES (main has none)
SNDBUF = 64 * 1024  # kv_events_zmq.SOCKET_SNDBUF (main has none)
MB = 1024 * 1024


def test_subscribers_that_stop_reading_hold_the_queue_not_the_state(shm_dir: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.streams.kv_state_rss", shm_dir, "200000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context()
    subs = []
    try:
        assert child.stdin is not None and child.stdout is not None
        endpoint = child.stdout.readline().strip()
        assert endpoint.startswith("tcp://"), endpoint
        for _ in range(8):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(endpoint)
            subs.append(s)
        for s in subs:  # one heartbeat each: subscribed; then none of them reads
            assert s.poll(60_000), "no heartbeat from the publisher"
            s.recv_multipart()
        child.stdin.write("go\n")
        child.stdin.flush()
        before, after, state, events = map(int, child.stdout.readline().split())
        assert events == 200_001 and state > 25 * MB
        held = after - before
        # the queue (2 MiB), the replay buffer (1 MiB), what was announced (19 bytes a
        # slot: 3.6 MiB) and what the allocator keeps; main: the whole state and more
        assert held < state * 0.5, (held / MB, state / MB)
        # and the kernel's send buffers of those connections, charged to the container's
        # cgroup too: main left them to autotuning, up to 4 MiB each
        if shutil.which("ss"):
            queued = _kernel_send_bytes(int(endpoint.rsplit(":", 1)[1]))
            assert len(queued) == len(subs), queued
            assert sum(queued) <= len(subs) * 2 * SNDBUF + 64 * 1024, queued
    finally:
        for s in subs:
            s.close(linger=0)
        ctx.term()
        if child.stdin is not None and child.poll() is None:
            child.stdin.write("done\n")
            child.stdin.close()
        child.wait(timeout=60)


def _kernel_send_bytes(port: int) -> list[int]:
    """The kernel memory of each connection's send side on this local port (``ss``'s
    skmem ``w``: what its send queue holds, not yet taken by the peer)."""
    out = subprocess.run(
        ["ss", "-tmnH", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(m) for m in re.findall(r"skmem:\(r\d+,rb\d+,t\d+,tb\d+,f\d+,w(\d+),", out)]


def test_every_batch_is_bounded_in_bytes(shm_dir: str) -> None:
    name = "kvevents.batches.dp0.tp0.pp0"
    w = KVEventsWriter(name, n_slots=6000, block_size=16, shm_dir=shm_dir)
    store_chains(w, 3000)
    ctx = zmq.Context()
    pub = kz.RankPublisher(
        name, shm_dir, KVEventsOptions("tcp://127.0.0.1:0", memory_bytes=1 << 40), ctx
    )
    sent: list[bytes] = []
    remember = pub._remember
    pub._remember = lambda seq, payload: (sent.append(payload), remember(seq, payload))  # type: ignore[method-assign,func-returns-value]
    try:
        pub.poll_once()  # the full state
        full = len(sent)
        for i in range(3000, 4500):  # live, one poll's records: 1,500 one-block events
            w.stored(i, i + 1, None, TOKENS)
        for i in range(4500, 6000):  # and one run of 1,500 blocks (one event over the cap)
            w.stored(i, i + 1, i if i > 4500 else None, TOKENS)
        pub.poll_once()
        pub._publish_held(pub.reader)  # type: ignore[arg-type]
        assert full > 1 and len(sent) > full
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        stored = 0
        for payload in sent:
            batch = decode(payload)
            events = [msgspec.msgpack.encode(e) for e in batch.events]
            assert len(events) == 1 or sum(map(len, events)) <= BATCH_BYTES, len(payload)
            stored += sum(len(getattr(e, "block_hashes", ())) for e in batch.events)
        assert stored == 6000  # every block once
        assert kz.PUB_QUEUE_MSGS * BATCH_BYTES <= 2 * MB
    finally:
        pub._close()
        w.close()
        ctx.term()


def _build_peak(shm_dir: str, blocks: int) -> int:
    name = f"kvevents.peak{blocks}.dp0.tp0.pp0"
    w = KVEventsWriter(name, n_slots=blocks, block_size=16, shm_dir=shm_dir)
    store_chains(w, blocks)
    r = KVEventsReader(name, shm_dir=shm_dir)
    assert r.attach() is None
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _head, columns = kv_events_state.scan(r)
        n = sum(len(b) for b in kv_events_state.batches(r, columns))
        assert n == blocks + 1
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        r.close()
        w.close()


def test_the_full_state_build_costs_a_bounded_number_of_bytes_a_block(shm_dir: str) -> None:
    small, large = 20_000, 80_000
    slope = (_build_peak(shm_dir, large) - _build_peak(shm_dir, small)) / (large - small)
    assert slope <= 26, slope  # main: 32.1
