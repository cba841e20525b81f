"""The bulk full state (kv_events_state) against the per-block path it replaced.

On random tables in a real segment (chains, duplicate hashes, parent cycles, LoRA ids and
names, media, groups, KV-cache specs, short blocks, removals, clears), the fast path's
payloads are byte for byte what `parents_first` + `stored_event` + msgspec give."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

from array import array

from kvsidecar.protocol.kv_events_reader import KVEventsReader
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_state
from kvsidecar.streams.kv_events_wire import AllBlocksCleared, EventBatch
from kvsidecar.streams.kv_events_zmq import parents_first, stored_event

SLOTS, BLOCK = 24, 4
SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
block = st.fixed_dictionaries(
    {
        "hash": st.sampled_from([1, 2, 3, 4, 5, 6, 7, 2**63 + 5, 2**64 - 1, 200, 70000]),
        "parent": st.none() | st.sampled_from([1, 2, 3, 4, 5, 9, 2**64 - 1, 70000]),
        "tokens": st.lists(st.integers(0, 2**32 - 1), max_size=BLOCK),
        "group": st.integers(0, 3),
        "medium": st.sampled_from(["GPU", "CPU", "STORAGE", None]),
        "lora_id": st.none() | st.integers(-(2**63), 2**63 - 1),
        "lora_name": st.none() | st.sampled_from(["a", "lora-b", "é"]),
        "spec": st.none() | st.sampled_from(["full_attention", "sliding_window 128", "mamba x"]),
    }
)
ops = st.lists(
    st.tuples(
        st.sampled_from(["store"] * 6 + ["remove", "clear"]), st.integers(0, SLOTS - 1), block
    ),
    max_size=60,
)


def _fill(w: KVEventsWriter, plan) -> dict[int, int]:
    cached: dict[int, int] = {}
    for op, slot, b in plan:
        if op == "store":
            w.stored(
                slot,
                b["hash"],
                b["parent"],
                b["tokens"],
                group_idx=b["group"],
                medium=b["medium"],
                lora_id=b["lora_id"],
                lora_name=b["lora_name"],
                spec=b["spec"],
            )
            cached[slot] = b["hash"]
        elif op == "remove" and slot in cached:
            w.removed(slot, cached.pop(slot))
        elif op == "clear":
            w.cleared()
            cached.clear()
    return cached


def _old_payloads(reader: KVEventsReader, blocks) -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    events = [AllBlocksCleared()] + [stored_event(reader, [b]) for b in parents_first(blocks)]
    return [
        enc.encode(EventBatch(ts=1.25, events=events[i : i + 7], data_parallel_rank=3))
        for i in range(0, len(events), 7)
    ]


def _new_payloads(events: list[bytes]) -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    return [
        kv_events_state.encode_batch(enc, 1.25, events[i : i + 7], 3)
        for i in range(0, len(events), 7)
    ]


def _open(shm_dir: str):
    w = KVEventsWriter(
        "kvevents.state", n_slots=SLOTS, block_size=BLOCK, shm_dir=shm_dir, ring_cap=64
    )
    r = KVEventsReader("kvevents.state", shm_dir=shm_dir)
    assert r.attach() is None
    return w, r


@SETTINGS
@given(plan=ops)
def test_full_state_is_the_per_block_path_byte_for_byte(shm_dir: str, plan) -> None:
    w, r = _open(shm_dir)
    try:
        cached = _fill(w, plan)
        head, _epoch, blocks = r.cached_blocks()
        head2, rows, events = kv_events_state.full_state(r)
        assert head2 == head
        assert sorted(rows.slots) == sorted(cached) == [b.slot for b in blocks]
        assert _new_payloads(events) == _old_payloads(r, blocks)
    finally:
        r.close()
        w.close()


@SETTINGS
@given(plan=ops, later=ops, stale=st.sets(st.integers(0, SLOTS - 1)))
def test_announced_state_is_the_per_slot_path(shm_dir: str, plan, later, stale) -> None:
    """What a replay older than the buffer sends: the slots still holding the version
    announced, cached or since removed (their removal not yet published)."""
    w, r = _open(shm_dir)
    try:
        _fill(w, plan)
        _h, _e, blocks = r.cached_blocks()
        announced = array("Q", bytes(8 * SLOTS))
        for b in blocks:
            announced[b.slot] = b.version + (1 if b.slot in stale else 0)
        _fill(w, later)  # the engine moved on after the announcement
        old = []
        for slot, v in enumerate(announced):
            if v:
                b = r.block(slot)
                if b is not None and b.version == v:
                    old.append(b)
        new = kv_events_state.announced_state(r, announced)
        assert _new_payloads(new) == _old_payloads(r, old)
    finally:
        r.close()
        w.close()


@SETTINGS
@given(plan=ops, later=ops, stale=st.sets(st.integers(0, SLOTS - 1)))
def test_the_state_in_small_chunks_is_the_same(shm_dir: str, plan, later, stale) -> None:
    """The table scanned 5 slots at a time, sorted by hash in runs of 3 rows, encoded in
    batches of 7 events: the same batches as the per-block path cut in 7s."""
    saved = kv_events_state.SCAN_ROWS, kv_events_state.SORT_CHUNK, kv_events_state.BATCH_EVENTS
    kv_events_state.SCAN_ROWS, kv_events_state.SORT_CHUNK, kv_events_state.BATCH_EVENTS = 5, 3, 7
    w, r = _open(shm_dir)
    try:
        _fill(w, plan)
        _h, _e, blocks = r.cached_blocks()
        _head, columns, events = kv_events_state.full_state(r)
        assert sorted(columns.slots) == [b.slot for b in blocks]
        assert _new_payloads(events) == _old_payloads(r, blocks)
        announced = array("Q", bytes(8 * SLOTS))
        for b in blocks:
            announced[b.slot] = b.version + (1 if b.slot in stale else 0)
        _fill(w, later)
        old = [b for b in map(r.block, range(SLOTS)) if b and b.version == announced[b.slot] > 0]
        _head, columns = kv_events_state.scan(r, kv_events_state.announced_rows(r, announced))
        got = list(kv_events_state.batches(r, columns))
        assert all(len(b) == 7 for b in got[:-1])
        assert _new_payloads([e for b in got for e in b]) == _old_payloads(r, old)
    finally:
        kv_events_state.SCAN_ROWS, kv_events_state.SORT_CHUNK, kv_events_state.BATCH_EVENTS = saved
        r.close()
        w.close()
