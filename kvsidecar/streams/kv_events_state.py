"""The full state of a KV-event segment as vLLM's wire, built in bulk (the daemon's snapshot).

A new writer incarnation and a replay older than the buffer both send every cached block
as a ``BlockStored`` of its own, parents first. Built per block from Python objects
(`Block`, `BlockStored`) that took 1.66 s per 100,000 blocks; here the table is read
with one C call per 16,384 slots (`KVEventsReader.cached_rows`), its columns are taken
with strided memoryview casts, and each event's msgpack is assembled from pieces encoded
once per distinct (block size, LoRA, medium, group, spec) plus the block's hash, parent
and token ids. The bytes are exactly what `stored_event` + msgspec give for the same
blocks (tests/streams/test_kv_events_state.py checks it on random tables).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.kv_events_reader import KVEventsReader
from kvsidecar.streams.kv_events_wire import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    signed_hash,
)

_enc = msgspec.msgpack.encode
CLEARED = _enc(AllBlocksCleared())
_K_PARENT = _enc("parent_block_hash")
_K_TOKENS = _enc("token_ids")
_NIL = b"\xc0"


class Rows:
    """Slot copies as the C scan gives them (``stride`` bytes each, the first 8 the slot's
    number), in slot order, and their columns (native casts of the little-endian layout:
    a little-endian host, as `_seqlock` assumes and checks at import)."""

    def __init__(self, data: bytes, stride: int, block_size: int) -> None:
        self.data = data
        self.stride = stride
        self.n = len(data) // stride
        mv = memoryview(data)
        q, s8 = mv.cast("Q"), stride // 8
        self.slots: list[int] = q[0::s8].tolist()
        self.versions: list[int] = q[1::s8].tolist()
        self.hashes: list[int] = q[2::s8].tolist()
        flags = mv[kvl.SLOT_OFF_FLAGS :: stride].tolist()
        parents = q[3::s8].tolist()
        self.parents: list[int | None] = [
            p if f & kvl.FLAG_HAS_PARENT else None for p, f in zip(parents, flags)
        ]
        h, s2 = mv.cast("H"), stride // 2
        lora_ids = mv.cast("q")[6::s8].tolist()
        # what the event's fields after token_ids depend on, one tuple per row
        self.keys = list(
            zip(
                [min(n, block_size) for n in h[20::s2].tolist()],  # n_tokens
                [i if f & kvl.FLAG_HAS_LORA_ID else None for i, f in zip(lora_ids, flags)],
                mv[37::stride].tolist(),  # medium
                h[21::s2].tolist(),  # lora name index
                h[19::s2].tolist(),  # group
                h[22::s2].tolist(),  # spec index
            )
        )
        self._u32 = mv.cast("I")

    def tokens(self, i: int) -> list[int]:
        base = (i * self.stride + kvl.SLOT_FIXED) // 4
        return self._u32[base : base + self.keys[i][0]].tolist()


def parents_first_order(hashes: list[int], parents: list[int | None]) -> list[int]:
    """Row indexes ordered so that a cached parent comes before its children, rows of equal
    depth in their (slot) order: `kv_events_zmq.parents_first`'s order, on columns."""
    parent_of = dict(zip(hashes, parents))  # the last row of a hash wins, as there
    depth: dict[int, int] = {}
    limit = len(parent_of)
    for h0 in hashes:
        if h0 in depth:
            continue
        chain = []
        h: int | None = h0
        while h is not None and h in parent_of and h not in depth:
            chain.append(h)
            h = parent_of[h]
            if len(chain) > limit:  # a cycle (corrupt hashes): stop
                break
        base = depth.get(h, -1) if h is not None else -1
        for i, x in enumerate(reversed(chain)):
            depth[x] = base + 1 + i
    by_row = [depth[h] for h in hashes]
    return sorted(range(len(hashes)), key=by_row.__getitem__)


class StoredEncoder:
    """Encodes one-block ``BlockStored`` events (as `kv_events_zmq.stored_event` makes
    them) from table rows, caching the pieces that depend only on the row's key."""

    def __init__(self, reader: KVEventsReader, signed: bool = False) -> None:
        self.reader = reader
        self.signed = signed  # SGLang's hash form: 64-bit hashes as signed ints
        self._pieces: dict[tuple, tuple[bytes, bytes]] = {}

    def _cut(self, key: tuple) -> tuple[bytes, bytes]:
        """(head, tail): the event's bytes before its hash and after its token ids, taken
        from msgspec's encoding of a sample event with this key."""
        n, lora_id, medium, name_idx, group, spec_idx = key
        lora_name = self.reader.lora_name(name_idx)
        spec = (self.reader.lora_name(spec_idx) or "").split(" ")
        window = spec[1] if len(spec) > 1 and spec[1].isdigit() else None
        sample = _enc(
            BlockStored(
                block_hashes=[0],
                parent_block_hash=None,
                token_ids=[],
                block_size=n,
                lora_id=lora_id,
                medium=kvl.MEDIA.get(medium),
                lora_name=lora_name,
                extra_keys=[None if lora_name is None else (lora_name,)],
                group_idx=group,
                kv_cache_spec_kind=spec[0] or None,
                kv_cache_spec_sliding_window=None if window is None else int(window),
            )
        )
        # sample = head + 0x00 (hash 0) + K_PARENT + nil + K_TOKENS + 0x90 ([]) + tail
        middle = b"\x00" + _K_PARENT + _NIL + _K_TOKENS + b"\x90"
        at = sample.index(middle)
        return sample[:at], sample[at + len(middle) :]

    def events(self, rows: Rows, order: Iterable[int]) -> list[bytes]:
        pieces, cut = self._pieces, self._cut
        hashes, parents, keys, tokens = rows.hashes, rows.parents, rows.keys, rows.tokens
        if self.signed:
            hashes = [signed_hash(h) for h in hashes]
            parents = [None if p is None else signed_hash(p) for p in parents]
        out = []
        for i in order:
            key = keys[i]
            p = pieces.get(key)
            if p is None:
                p = pieces[key] = cut(key)
            parent = parents[i]
            out.append(
                b"".join(
                    (
                        p[0],
                        _enc(hashes[i]),
                        _K_PARENT,
                        _NIL if parent is None else _enc(parent),
                        _K_TOKENS,
                        _enc(tokens(i)),
                        p[1],
                    )
                )
            )
        return out


def array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_batch(
    enc: msgspec.msgpack.Encoder, ts: float, events: list[bytes], dp_rank: int | None
) -> bytes:
    """An EventBatch payload of events already encoded: the bytes msgspec gives for the
    batch of the same events as objects."""
    raw = msgspec.Raw(array_header(len(events)) + b"".join(events))
    return enc.encode(EventBatch(ts=ts, events=raw, data_parallel_rank=dp_rank))  # type: ignore[arg-type]


def full_state(reader: KVEventsReader, signed: bool = False) -> tuple[int, Rows, list[bytes]]:
    """(head loaded before the scan, the rows, CLEARED + a BlockStored per cached block,
    parents first): what a new writer incarnation's subscribers are sent."""
    head, _epoch, data = reader.cached_rows()
    g = reader.geometry
    assert g is not None
    rows = Rows(data, g.slot_stride, g.block_size)
    order = parents_first_order(rows.hashes, rows.parents)
    return head, rows, [CLEARED, *StoredEncoder(reader, signed).events(rows, order)]


def announced_state(
    reader: KVEventsReader, announced: Sequence[int], signed: bool = False
) -> list[bytes]:
    """CLEARED + a BlockStored per slot whose table entry still holds the version
    ``announced[slot]`` says was published (0: nothing), parents first: a replay's full
    state as of the last published sequence. Cached slots come from the bulk scan; an
    announced slot the scan did not return (removed, cleared or mid-write since) is read
    alone, as a slot whose removal is not yet published still counts."""
    _head, _epoch, data = reader.cached_rows()
    g = reader.geometry
    assert g is not None
    stride = g.slot_stride
    scanned = Rows(data, stride, g.block_size)
    keep = [
        i
        for i, (slot, v) in enumerate(zip(scanned.slots, scanned.versions))
        if announced[slot] == v
    ]
    picked = {scanned.slots[i]: data[i * stride : (i + 1) * stride] for i in keep}
    if len(announced) - announced.count(0) > len(picked):
        seen = set(scanned.slots)
        for slot, v in enumerate(announced):
            if v and slot not in seen:
                raw = reader.slot_row(slot)
                if raw is not None and int.from_bytes(raw[8:16], "little") == v:
                    picked[slot] = raw
    if len(keep) == len(picked) == scanned.n:  # the scan, as it was
        rows = scanned
    else:
        rows = Rows(b"".join(picked[s] for s in sorted(picked)), stride, g.block_size)
    order = parents_first_order(rows.hashes, rows.parents)
    return [CLEARED, *StoredEncoder(reader, signed).events(rows, order)]
