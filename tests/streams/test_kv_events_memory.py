"""What the KV-event publisher holds in memory is bounded in bytes (#43 item 8).

The real RankPublisher over a real KV-event segment (KVEventsWriter), real ZMQ over
loopback TCP. On bc42d3d the replay buffer kept --kv-events.buffer-steps batches
whatever their size (10,000 batches of 1,024 BlockStored: hundreds of MB), and each
replay client got the whole buffer queued at once (SNDHWM 2 x (buffer_steps + 1)), so
clients that ask and never read held a copy of it each (in the ROUTER's queues; now a
client's queue holds REPLAY_QUEUE_MSGS messages and the rest waits as references).
"""

from __future__ import annotations

import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.bench.fleet import free_port
from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_zmq as kz
from kvsidecar.streams.kv_events_wire import BlockStored

NAME = "kvevents.mem.dp0.tp0.pp0"
MB = 1024 * 1024
BUFFER_BYTES = kz.REPLAY_BUFFER_BYTES  # 1 MiB (docs/kv-events.md, Memory)


def _batch(i: int) -> list[object]:
    """One engine step's worth of stores: 64 blocks of 256 tokens (about 40 KB encoded)."""
    return [
        BlockStored([i * 64 + j], None, list(range(256)), 256, None, None, None) for j in range(64)
    ]


def _publisher(shm_dir: str, buffer_steps: int):  # type: ignore[no-untyped-def]
    w = KVEventsWriter(NAME, n_slots=64, block_size=4, shm_dir=shm_dir, ring_cap=64)
    ctx = zmq.Context()
    replay_port = free_port()
    options = KVEventsOptions(
        f"tcp://127.0.0.1:{free_port()}",
        f"tcp://127.0.0.1:{replay_port}",
        buffer_steps=buffer_steps,
    )
    pub = kz.RankPublisher(NAME, shm_dir, options, ctx)
    pub.poll_once()  # attaches, binds
    assert pub._replay is not None
    return w, ctx, pub, replay_port


def test_the_replay_buffer_is_bounded_in_bytes(shm_dir: str) -> None:
    w, ctx, pub, _ = _publisher(shm_dir, 2_000)
    try:
        for i in range(2_000):  # 2,000 steps of ~40 KB: ~80 MB if kept by steps
            pub._publish(_batch(i))
        held = sum(len(p) for _, p in pub._buffer)
        assert held <= BUFFER_BYTES, held / MB  # bc42d3d: every one of the 2,000 (83 MB)
        assert held > BUFFER_BYTES - 64 * 1024  # as many as fit
        assert pub._buffer[-1][0] == pub.seq  # the newest kept
    finally:
        pub._close()
        w.close()
        ctx.term()


def test_a_slow_replay_client_still_gets_the_whole_answer(shm_dir: str) -> None:
    """More batches than a client's queue holds: a client that reads late still gets
    every buffered batch and the end marker."""
    w = KVEventsWriter(NAME, n_slots=64, block_size=4, shm_dir=shm_dir, ring_cap=64)
    ctx = zmq.Context()
    replay_port = free_port()
    options = KVEventsOptions(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{replay_port}", buffer_steps=500
    )
    pub = kz.RankPublisher(NAME, shm_dir, options, ctx)
    c = ctx.socket(zmq.DEALER)
    try:
        pub.poll_once()
        first = pub.seq + 1
        for i in range(20):  # 0.8 MB: within the buffer's bytes, cut in 8 KiB batches
            pub._publish(_batch(i))
        last = pub.seq
        assert last - first + 1 > 4 * kz.REPLAY_QUEUE_MSGS  # more than a client's queue
        c.connect(f"tcp://127.0.0.1:{replay_port}")
        c.send_multipart([b"", first.to_bytes(8, "big")])
        for _ in range(20):  # the client reads nothing yet
            pub._serve_replay(0.01)
        got = []
        while True:
            for _ in range(5):
                pub._serve_replay(0.01)
            if not c.poll(5_000):
                break
            frames = c.recv_multipart()
            if frames[2] == kz.END_SEQ:
                break
            got.append(int.from_bytes(frames[2], "big"))
        assert got == list(range(first, last + 1))
    finally:
        c.close(linger=0)
        pub._close()
        w.close()
        ctx.term()


def test_subscribers_and_replay_clients_that_never_read_hold_little() -> None:
    """The real daemon over 50,000 blocks: 16 subscribers and 16 replay clients (each
    asking for the full state, 7.8 MB) that never read. bc42d3d queued every answer whole
    to each client: +88 MB; now one full state shared and a few messages each: +10 MB."""
    from tests.attacks import kv_events_memory

    r = kv_events_memory.run(blocks=50_000, subscribers=16, replays=16, settle=5.0)
    grown = r["rss_with_clients_mb"] - r["rss_mb"]
    assert grown < 24, r
