"""An SGLang segment's hashes go out as SGLang's own publisher sends them: signed 64-bit
ints (``hash_str_to_int64``); a vLLM segment's stay unsigned (vLLM's int form). Live
events, removals, and the full state a late replay gets."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams.kv_events_wire import KVEventBatch
from kvsidecar.streams.kv_events_zmq import RankPublisher

PARENT = (1 << 64) - 5  # -5 as SGLang's signed int64
CHILD = 1 << 63  # -2**63
OTHER = 12345  # below 2**63: the same either way


def published(shm_dir: str, name: str) -> tuple[list[list[int | None]], list[list[int]]]:
    """(hashes and parent of each BlockStored, hashes of each BlockRemoved) the publisher
    sent for a segment called ``name``: live, then its full state as replayed."""
    w = KVEventsWriter(name, n_slots=4, block_size=2, shm_dir=shm_dir)
    ctx = zmq.Context()
    pub = RankPublisher(name, shm_dir, KVEventsOptions("inproc://s"), ctx)
    try:
        pub.poll_once()
        w.stored(0, PARENT, None, [1, 2])
        w.stored(1, CHILD, PARENT, [3, 4], first=False)
        w.stored(2, OTHER, None, [5, 6])
        w.removed(2, OTHER)
        pub.poll_once()
        payloads = [p for _, p in pub._buffer] + list(pub._state_batches())
    finally:
        pub._close()
        w.close()
        ctx.term()
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    stored, removed = [], []
    for p in payloads:
        for e in dec.decode(p).events:
            if type(e).__name__ == "BlockStored":
                stored.append([*e.block_hashes, e.parent_block_hash])
            elif type(e).__name__ == "BlockRemoved":
                removed.append(e.block_hashes)
    return stored, removed


def test_sglang_segments_send_signed_hashes_vllm_segments_unsigned(shm_dir: str) -> None:
    stored, removed = published(shm_dir, "kvevents.sglang.dp0.tp0.pp0")
    # Live: one run of two blocks, the other block; then the state: parents first.
    assert stored == [[-5, -(1 << 63), None], [OTHER, None], [-5, None], [-(1 << 63), -5]]
    assert removed == [[OTHER]]
    stored, removed = published(shm_dir, "kvevents.vllm.dp0.tp0.pp0")
    assert stored == [[PARENT, CHILD, None], [OTHER, None], [PARENT, None], [CHILD, PARENT]]
    assert removed == [[OTHER]]
