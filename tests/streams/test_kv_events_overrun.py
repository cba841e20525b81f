"""The daemon fallen behind the engine's ring (an overrun): its diff of the table against
what was announced is right and bounded (issue 43 item 8: the last part of the KV-event
publisher that held a Python object per cached block, the whole table at once).

Right: after any mix of stores, removals and re-stores past the ring, a consumer applying
the published events holds exactly the table's cached set, and every block stored by the
diff whose parent is stored by it too comes after that parent. Bounded: the diff's
traced memory grows by a bounded number of bytes a changed block (tracemalloc, the slope
between two table sizes; main: 300 and more, a `Block`, a dict entry and an event each).
"""

from __future__ import annotations

import random
import tracemalloc

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_zmq as kz
from kvsidecar.streams.kv_events_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

TOKENS = list(range(16))
RING = 64  # records: a diff follows any 65 changes the publisher did not read


class Table:
    """A writer, the engine's own view of it (slot -> (hash, parent)), and a publisher
    whose published batches are kept (or, with ``count``, only their events counted by
    kind: a test of memory must not hold them)."""

    def __init__(self, shm_dir: str, name: str, n_slots: int, count: bool = False) -> None:
        self.w = KVEventsWriter(
            name, n_slots=n_slots, block_size=16, ring_cap=RING, shm_dir=shm_dir
        )
        self.cached: dict[int, tuple[int, int | None]] = {}
        self.next_hash = 1
        self.ctx = zmq.Context()
        self.pub = kz.RankPublisher(
            name, shm_dir, KVEventsOptions("tcp://127.0.0.1:0", memory_bytes=1 << 40), self.ctx
        )
        self.sent: list[bytes] = []
        self.counts = {"stored": 0, "removed": 0}
        remember = self.pub._remember
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode

        def kept(seq: int, payload: bytes) -> None:
            if count:
                for e in decode(payload).events:
                    if isinstance(e, BlockStored):
                        self.counts["stored"] += len(e.block_hashes)
                    elif isinstance(e, BlockRemoved):
                        self.counts["removed"] += len(e.block_hashes)
            else:
                self.sent.append(payload)
            remember(seq, payload)

        self.pub._remember = kept  # type: ignore[method-assign]

    def store(self, slot: int, parent_slot: int | None) -> None:
        parent = self.cached.get(parent_slot)[0] if parent_slot in self.cached else None
        h, self.next_hash = self.next_hash, self.next_hash + 1
        self.w.stored(slot, h, parent, TOKENS)
        self.cached[slot] = (h, parent)

    def remove(self, slot: int) -> None:
        if slot in self.cached:
            self.w.removed(slot, self.cached.pop(slot)[0])

    def close(self) -> None:
        self.pub._close()
        self.w.close()
        self.ctx.term()


def _consume(payloads: list[bytes]) -> tuple[set[int], list[list[tuple[int, int | None]]]]:
    """The set a consumer holds, and each batch's stores as (hash, parent)."""
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    held: set[int] = set()
    stores = []
    for p in payloads:
        batch = []
        for e in decode(p).events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif isinstance(e, BlockRemoved):
                held.difference_update(e.block_hashes)
            elif isinstance(e, BlockStored):
                held.update(e.block_hashes)
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    batch.append((h, parent))
                    parent = h
        stores.append(batch)
    return held, stores


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**32 - 1), slots=st.sampled_from([40, 300, 2000]))
def test_an_overrun_leaves_consumers_with_the_table(shm_dir, seed, slots):
    rng = random.Random(seed)
    t = Table(shm_dir, f"kvevents.over{seed % 997}.dp0.tp0.pp0", slots)
    try:
        for s in range(slots // 2):  # a first state, chains included
            t.store(s, s - 1 if s % 5 else None)
        t.pub.poll_once()
        for _ in range(RING + rng.randrange(1, 3 * slots)):  # past the ring
            s = rng.randrange(slots)
            if rng.random() < 0.4:
                t.remove(s)
            else:
                t.store(s, rng.randrange(slots) if rng.random() < 0.7 else None)
        t.pub.poll_once()
        assert t.pub.stats["overruns"] == 1
        held, stores = _consume(t.sent)
        assert held == {h for h, _ in t.cached.values()}
        diff = [x for batch in stores[1:] for x in batch]  # after the first full state
        position = {h: i for i, (h, _) in enumerate(diff)}
        for i, (_h, parent) in enumerate(diff):
            if parent in position:
                assert position[parent] < i, "a child stored before its parent"
    finally:
        t.close()


def _diff_peak(shm_dir: str, blocks: int) -> int:
    """tracemalloc's peak over the diff after every block was re-stored past the ring."""
    t = Table(shm_dir, f"kvevents.diffpeak{blocks}.dp0.tp0.pp0", blocks, count=True)
    try:
        for s in range(blocks):
            t.store(s, s - 1 if s % 64 else None)
        t.pub.poll_once()
        for s in range(blocks):  # each slot re-stored: a removal and a store each
            t.store(s, s - 1 if s % 64 else None)
        t.counts = {"stored": 0, "removed": 0}
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            t.pub.poll_once()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert t.pub.stats["overruns"] == 1
        assert t.counts == {"stored": blocks, "removed": blocks}
        return peak
    finally:
        t.close()


def test_the_diff_costs_a_bounded_number_of_bytes_a_block(shm_dir):
    small, large = 10_000, 40_000
    slope = (_diff_peak(shm_dir, large) - _diff_peak(shm_dir, small)) / (large - small)
    assert slope <= 40, slope
