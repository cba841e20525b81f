"""A replay answer is dropped for its client's stall, never for the publisher's own work.

The real RankPublisher over a real KV-event segment, real ZMQ over loopback TCP, and a
replay client asking for the full state. Encoding the state's first batch orders the
whole table: 2.7 s under tracemalloc on an idle host, over REPLAY_STALL_S on a loaded
one, where CI once saw a client that read the whole time get 1,285 of 40,001 events and
then nothing: the sends after the encode were stamped with the clock read before it, so
the next full queue looked stalled since before the encode. Here one batch's encode is
made slower than a lowered REPLAY_STALL_S, with the pipeline to the client saturated; the
client that reads gets the whole state, and one that reads nothing is still dropped.
"""

from __future__ import annotations

import time

import msgspec
import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.bench.fleet import free_port
from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_zmq as kz
from kvsidecar.streams.kv_events_wire import KVEventBatch
from tests.support.kv_chains import store_chains

NAME = "kvevents.stall.dp0.tp0.pp0"
BLOCKS = 10_000
STALL_S = 1.0
ENCODE_S = 2.5 * STALL_S  # the publisher's own work on one batch


class _SlowOnce:
    """What makes RankPublisher._batch ENCODE_S slower the once it is armed."""

    def __init__(self) -> None:
        self.armed, self.used = False, False

    def wrap(self, encode):  # type: ignore[no-untyped-def]
        def _batch(pub: kz.RankPublisher, events: list[bytes]) -> bytes:
            if self.armed:
                self.armed, self.used = False, True
                time.sleep(ENCODE_S)
            return encode(pub, events)

        return _batch


@pytest.fixture
def publisher(shm_dir: str, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(kz, "REPLAY_BUFFER_BYTES", 16 * 1024)  # the state leaves the buffer
    monkeypatch.setattr(kz, "REPLAY_STALL_S", STALL_S)
    slow = _SlowOnce()
    monkeypatch.setattr(kz.RankPublisher, "_batch", slow.wrap(kz.RankPublisher._batch))
    w = KVEventsWriter(NAME, n_slots=BLOCKS, block_size=16, shm_dir=shm_dir)
    store_chains(w, BLOCKS)
    ctx = zmq.Context()
    port, replay_port = free_port(), free_port()
    options = KVEventsOptions(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    pub = kz.RankPublisher(NAME, shm_dir, options, ctx)
    c = ctx.socket(zmq.DEALER)
    try:
        pub.poll_once()  # attaches, publishes the full state
        assert pub.stats["events"] == BLOCKS + 1 and pub._buffer[0][0] > 0
        c.setsockopt(zmq.RCVHWM, 1)
        c.setsockopt(zmq.RCVBUF, 4096)
        c.connect(f"tcp://127.0.0.1:{replay_port}")
        yield pub, c, slow
    finally:
        c.close(linger=0)
        pub._close()
        w.close()
        ctx.term()


def _serve_for(pub: kz.RankPublisher, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pub._serve_replay(0.01)


def _ask_full_state(pub: kz.RankPublisher, c: zmq.Socket) -> None:
    """Ask, then serve (the client reading nothing) until everything between the
    publisher's answer and the client is full."""
    c.send_multipart([b"", (0).to_bytes(8, "big")])
    for _ in range(500):
        pub._serve_replay(0.01)
        if pub.stats["replays"]:
            break
    assert pub.stats["replays"] == 1 and pub._stream is not None
    _serve_for(pub, STALL_S / 3)
    assert pub._pending


def _read(c: zmq.Socket, most: int) -> tuple[int, set[bytes], bool]:
    """Events and sequences read (at most ``most`` messages), and whether the end came."""
    stored, seqs, n = 0, set(), 0
    while n < most and c.poll(2_000):
        frames = c.recv_multipart()
        if frames[2] == kz.END_SEQ:
            return stored, seqs, True
        seqs.add(frames[2])
        stored += len(msgspec.msgpack.decode(frames[3], type=KVEventBatch).events)
        n += 1
    return stored, seqs, False


def test_a_slow_encode_is_not_charged_to_the_client(publisher) -> None:  # type: ignore[no-untyped-def]
    pub, c, slow = publisher
    _ask_full_state(pub, c)
    stored, seqs, _ = _read(c, most=8)  # room for a few more, the rest still full
    time.sleep(0.2)  # the room reaches the publisher's queue
    slow.armed = True
    pub._serve_replay(0.01)  # sends, encodes the next batch for ENCODE_S, sends to full
    assert slow.used
    pub._serve_replay(0.01)  # the queue full since just now: main dropped the answer here
    assert pub._pending, "the answer was dropped as stalled for the publisher's own encode"
    while True:  # read everything now: the whole state, under one sequence
        pub._serve_replay(0.001)
        more, more_seqs, end = _read(c, most=1)
        stored, seqs = stored + more, seqs | more_seqs
        if end or not (more or more_seqs):
            break
    assert end and stored == BLOCKS + 1 and len(seqs) == 1, (end, stored, len(seqs))
    assert not pub._pending


def test_a_client_that_reads_nothing_is_still_dropped(publisher) -> None:  # type: ignore[no-untyped-def]
    pub, c, slow = publisher
    _ask_full_state(pub, c)
    deadline = time.monotonic() + 10 * STALL_S
    while pub._pending and time.monotonic() < deadline:
        pub._serve_replay(0.01)
    assert not pub._pending and pub._stream is None
    assert not slow.used
