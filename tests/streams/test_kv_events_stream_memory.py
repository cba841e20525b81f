"""The full state is sent in batches, never held whole (#43 item 8).

The real RankPublisher over a real KV-event segment of 40,000 blocks (about 6 MB of
encoded state), real ZMQ over loopback TCP, the replay buffer and the state window
lowered to 256 KB: what Python holds at the peak (tracemalloc) while a new writer
incarnation's full state is published, and while a replay client that asked for the
full state does not read, stays well below the state's size. On main (the state built
whole: every event, the table's copies and its columns as Python lists) the peak was
several times the state's size.
"""

from __future__ import annotations

import tracemalloc

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

NAME = "kvevents.stream.dp0.tp0.pp0"
BLOCKS = 40_000
SMALL = 256 * 1024


def _peak(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    fn()
    return tracemalloc.get_traced_memory()[1] - before


def test_the_full_state_is_never_held_whole(shm_dir: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(kz, "REPLAY_BUFFER_BYTES", SMALL)
    monkeypatch.setattr(kz, "STATE_WINDOW_BYTES", SMALL, raising=False)
    w = KVEventsWriter(NAME, n_slots=BLOCKS, block_size=16, shm_dir=shm_dir)
    store_chains(w, BLOCKS)
    ctx = zmq.Context()
    port, replay_port = free_port(), free_port()
    options = KVEventsOptions(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", memory_bytes=1 << 40
    )
    pub = kz.RankPublisher(NAME, shm_dir, options, ctx)
    sent: list[bytes] = []
    remember = pub._remember
    pub._remember = lambda seq, payload: (sent.append(len(payload)), remember(seq, payload))  # type: ignore[method-assign,func-returns-value]
    c = ctx.socket(zmq.DEALER)
    tracemalloc.start()
    try:
        resync = _peak(pub.poll_once)  # attaches, publishes the full state
        state = sum(sent)
        assert pub.stats["events"] == BLOCKS + 1 and state > 5_000_000
        assert resync < state * 0.8, (resync, state)  # main: 3.6 x state

        c.setsockopt(zmq.RCVHWM, 1)
        c.setsockopt(zmq.RCVBUF, 4096)
        c.connect(f"tcp://127.0.0.1:{replay_port}")
        c.send_multipart([b"", (0).to_bytes(8, "big")])

        def serve() -> None:
            for _ in range(40):
                pub._serve_replay(0.01)

        replay = _peak(serve)  # the client reads nothing
        assert replay < state * 0.8, (replay, state)  # main: the whole state and more
        tracemalloc.stop()
        # read it all now: the whole state, stamped with one sequence, then the end
        stored, seqs = 0, set()
        while True:
            pub._serve_replay(0.001)
            if not c.poll(5_000):
                break
            frames = c.recv_multipart()
            if frames[2] == kz.END_SEQ:
                break
            seqs.add(frames[2])
            stored += len(msgspec.msgpack.decode(frames[3], type=KVEventBatch).events)
        assert stored == BLOCKS + 1 and len(seqs) == 1
    finally:
        tracemalloc.stop()
        c.close(linger=0)
        pub._close()
        w.close()
        ctx.term()
