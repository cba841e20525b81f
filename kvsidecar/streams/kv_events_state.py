"""The full state of a KV-event segment as vLLM's wire, in bounded batches (the daemon's snapshot).

A new writer incarnation and a replay older than the buffer both send every cached block
as a ``BlockStored`` of its own, parents first. Built per block from Python objects
(`Block`, `BlockStored`) that took 1.66 s per 100,000 blocks; here the table is read
with one C call per 512 cached slots (`KVEventsReader.cached_row_chunks`), its columns are
taken with strided memoryview casts, and each event's msgpack is assembled from pieces
encoded once per distinct (block size, LoRA, medium, group, spec) plus the block's hash,
parent and token ids. The bytes are exactly what `stored_event` + msgspec give for the
same blocks (tests/streams/test_kv_events_state.py checks it on random tables).

Nothing holds the whole state: `scan` keeps compact columns of the cached rows (16 bytes
a block), `Columns.order` orders them parents first on arrays, reading the parents from
the table again and consuming the hash column (25 bytes a block in arrays while it
runs, plus one run's sort), and `batches` reads each batch's slots again (one C call a
slot: 12 bytes a block left then) and encodes them when the batch is asked for: one
batch (at most BATCH_EVENTS events and BATCH_BYTES bytes) at a time. A slot whose
version changed between the reads (its data gone) is left out, its change being in the
ring after the head.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence

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

    def subset(self, keep: Sequence[int], block_size: int) -> Rows:
        """The rows ``keep`` (indexes, in order) alone."""
        if len(keep) == self.n:
            return self
        stride = self.stride
        data = b"".join(self.data[i * stride : (i + 1) * stride] for i in keep)
        return Rows(data, stride, block_size)


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


def full_state(reader: KVEventsReader, signed: bool = False) -> tuple[int, Columns, list[bytes]]:
    """(head loaded before the scan, the rows' columns, CLEARED + a BlockStored per
    cached block, parents first): what a new writer incarnation's subscribers are sent,
    whole (the daemon sends `batches` one at a time)."""
    head, columns = scan(reader)
    return head, columns, [e for b in batches(reader, columns, signed=signed) for e in b]


def announced_state(
    reader: KVEventsReader, announced: Sequence[int], signed: bool = False
) -> list[bytes]:
    """CLEARED + a BlockStored per slot whose table entry still holds the version
    ``announced[slot]`` says was published (0: nothing), parents first: a replay's full
    state as of the last published sequence, whole (the daemon sends `batches`)."""
    _head, columns = scan(reader, announced_rows(reader, announced))
    return [e for b in batches(reader, columns, signed=signed) for e in b]


# -- the full state in bounded batches --------------------------------------------------

BATCH_EVENTS = 1024  # events per EventBatch (kv_events_zmq.MAX_EVENTS_PER_BATCH)
# bytes of events per EventBatch (an event over it goes alone): what a queue of N messages
# holds is bounded by N batches of this, not N of 1,024 events (about 200 KB at block size
# 16, and more with larger blocks)
BATCH_BYTES = 8 * 1024
SORT_CHUNK = 16384  # rows sorted by hash at a time (their runs are then merged)
# copies per table scan call: a chunk's `Rows` (Python lists) take ~500 bytes a row (256 KB)
SCAN_ROWS = 512


class Columns:
    """What the parents-first order needs of each kept row, in slot order, as arrays:
    slot and the low 32 bits of its version (4 bytes each: a slot rewritten 2**32 times
    between the scan and its batch is not a case) and hash (8): 16 bytes a row. Parents
    are read again from the table when the order is computed (`order`)."""

    def __init__(self) -> None:
        self.slots = array("I")
        self.versions = array("I")
        self.hashes = array("Q")

    def add(self, rows: Rows, keep: Iterable[int]) -> None:
        for i in keep:
            self.slots.append(rows.slots[i])
            self.versions.append(rows.versions[i] & 0xFFFFFFFF)
            self.hashes.append(rows.hashes[i])

    def order(self, reader: KVEventsReader) -> array:
        """Row indexes, parents first (`kv_events_zmq.parents_first`'s order, the same
        on every table, cycles included), computed on arrays (`Columns`), consuming the
        hash column: 25 bytes a row in arrays while it runs (no sorted copy of the
        hashes: they are looked up through the row order; parents read from the table
        again, `_uplinks`), 12 after."""
        n, sort_chunk = len(self.slots), SORT_CHUNK
        key = self.hashes.__getitem__
        # rows by hash (stable: equal hashes in row order), sorted in runs then merged
        runs = [
            array("I", sorted(range(a, min(a + sort_chunk, n)), key=key))
            for a in range(0, n, sort_chunk)
        ]
        by_hash = array("I", bytes(4 * n))
        for k, r in enumerate(heapq.merge(*runs, key=key)):
            by_hash[k] = r
        del runs
        # the row standing for each hash is the last row of it (as in a dict): the others
        # (equal hashes: rare) are mapped to it
        node: dict[int, int] = {}
        for k in range(n - 1):
            if key(by_hash[k]) == key(by_hash[k + 1]):
                node[by_hash[k]] = by_hash[k + 1]
        for r in sorted(node, reverse=True):  # a run of equal hashes: its last row
            node[r] = node.get(node[r], node[r])
        up = self._uplinks(reader, by_hash)
        del by_hash, key
        self.hashes = None  # type: ignore[assignment]
        limit = n - len(node)  # distinct hashes
        depth = array("i", [-1]) * n
        for r0 in range(n):
            h = node.get(r0, r0)
            if depth[h] >= 0:
                continue
            chain = []
            while h >= 0 and depth[h] < 0:
                chain.append(h)
                h = up[h]
                if len(chain) > limit:  # a cycle (corrupt hashes): stop
                    break
            base = depth[h] if h >= 0 else -1
            for i, x in enumerate(reversed(chain)):
                depth[x] = base + 1 + i
        del up
        # a stable counting sort by depth (row order within a depth)
        for r, h in node.items():
            depth[r] = depth[h]
        counts = array("I", bytes(4 * (max(depth, default=0) + 2)))
        for d in depth:
            counts[d + 1] += 1
        for d in range(1, len(counts)):
            counts[d] += counts[d - 1]
        order = array("I", bytes(4 * n))
        for r in range(n):
            d = depth[r]
            order[counts[d]] = r
            counts[d] += 1
        return order

    def _uplinks(self, reader: KVEventsReader, by_hash: array) -> array:
        """up[r]: the row standing for row r's parent hash (the last of the rows with
        that hash in ``by_hash``, the rows by hash), -1 when it has none or that hash is
        not cached. The parents are read from the table again, a chunk of
        SCAN_ROWS cached slots at a time, for the rows whose slot holds the version
        scanned; a row not among them (an announced slot that is not cached, or was
        mid-write) is read alone, and one changed since (left out of the batches) has
        none."""
        key = self.hashes.__getitem__

        def standing(p: int) -> int:
            k = bisect_right(by_hash, p, key=key) - 1
            return by_hash[k] if k >= 0 and key(by_hash[k]) == p else -1

        g = reader.geometry
        assert g is not None
        stride, s8 = g.slot_stride, g.slot_stride // 8
        slots, versions, n = self.slots, self.versions, len(self.slots)
        up = array("i", [-1]) * n
        seen = bytearray(n)
        r = 0
        _head, _epoch, chunks = reader.cached_row_chunks(SCAN_ROWS)
        for _first, _end, data in chunks:
            mv = memoryview(data)
            q = mv.cast("Q")
            for slot, v, p, f in zip(
                q[0::s8], q[1::s8], q[3::s8], mv[kvl.SLOT_OFF_FLAGS :: stride]
            ):
                while r < n and slots[r] < slot:
                    r += 1
                if r < n and slots[r] == slot and versions[r] == v & 0xFFFFFFFF:
                    seen[r] = 1
                    if f & kvl.FLAG_HAS_PARENT:
                        up[r] = standing(p)
        for r in range(n):
            if not seen[r]:
                raw = reader.slot_row(slots[r])
                if (
                    raw is not None
                    and int.from_bytes(raw[8:12], "little") == versions[r]
                    and raw[kvl.SLOT_OFF_FLAGS] & kvl.FLAG_HAS_PARENT
                ):
                    up[r] = standing(int.from_bytes(raw[24:32], "little"))
        return up


def scan(
    reader: KVEventsReader,
    pick: Callable[[int, int, Rows], Rows] | None = None,
    chunk: int | None = None,
) -> tuple[int, Columns]:
    """(head loaded before the scan, the columns of the cached rows): the table read
    ``chunk`` (SCAN_ROWS) copies at a time; ``pick(first slot, end slot, chunk's rows)`` gives the
    rows kept of each chunk (default: all), in slot order."""
    head, _epoch, chunks = reader.cached_row_chunks(chunk or SCAN_ROWS)
    g = reader.geometry
    assert g is not None
    columns = Columns()
    for first, end, data in chunks:
        rows = Rows(data, g.slot_stride, g.block_size)
        if pick is not None:
            rows = pick(first, end, rows)
        columns.add(rows, range(rows.n))
    return head, columns


def announced_rows(
    reader: KVEventsReader, announced: Sequence[int]
) -> Callable[[int, int, Rows], Rows]:
    """A `scan` pick: the rows whose version is the one ``announced[slot]`` says was
    published, and the announced slots of the chunk the scan did not return (removed,
    cleared or mid-write since: a removal not yet published still counts) read alone,
    as `announced_state` does."""
    g = reader.geometry
    assert g is not None
    stride = g.slot_stride

    def pick(first: int, end: int, rows: Rows) -> Rows:
        keep = [i for i, (s, v) in enumerate(zip(rows.slots, rows.versions)) if announced[s] == v]
        if len(keep) == rows.n and (end - first) - announced[first:end].count(0) == rows.n:
            return rows
        picked = {rows.slots[i]: rows.data[i * stride : (i + 1) * stride] for i in keep}
        seen = set(rows.slots)
        for slot in range(first, end):
            v = announced[slot]
            if v and slot not in seen:
                raw = reader.slot_row(slot)
                if raw is not None and int.from_bytes(raw[8:16], "little") == v:
                    picked[slot] = raw
        return Rows(b"".join(picked[s] for s in sorted(picked)), stride, g.block_size)

    return pick


def batches(
    reader: KVEventsReader,
    columns: Columns,
    drop: Callable[[int], None] | None = None,
    signed: bool = False,
    cleared: bool = True,
) -> Iterator[list[bytes]]:
    """CLEARED (unless not ``cleared``) + a BlockStored per row of ``columns``, parents
    first, in batches of at most BATCH_EVENTS events and BATCH_BYTES bytes (`cut`), each
    batch encoded when it is asked for: the events of one batch exist at a time. Each
    slot is read again; one whose version is no longer the one scanned (its data gone:
    its change is in the ring) is left out, and ``drop(slot)`` told."""
    g = reader.geometry
    assert g is not None
    order = columns.order(reader)
    slots, versions = columns.slots, columns.versions
    encoder = StoredEncoder(reader, signed)
    events, size = [CLEARED] if cleared else [], BATCH_EVENTS
    for a in range(0, len(order), size):
        raws = []
        for r in order[a : a + size]:
            slot = slots[r]
            raw = reader.slot_row(slot)
            if raw is not None and int.from_bytes(raw[8:12], "little") == versions[r]:
                raws.append(raw)
            elif drop is not None:
                drop(slot)
        rows = Rows(b"".join(raws), g.slot_stride, g.block_size)
        events.extend(encoder.events(rows, range(rows.n)))
        yield from cut(events)
    yield from cut(events, end=True)


def cut(events: list[bytes], end: bool = False) -> Iterator[list[bytes]]:
    """Batches taken from the front of ``events`` (encoded events), in order: at most
    BATCH_EVENTS events and BATCH_BYTES bytes each (an event over it goes alone); the
    events that do not fill a batch stay, unless ``end``."""
    start = count = size = 0
    for i, e in enumerate(events):
        if count and (count == BATCH_EVENTS or size + len(e) > BATCH_BYTES):
            yield events[start:i]
            start, count, size = i, 0, 0
        count += 1
        size += len(e)
    if end and count:
        yield events[start:]
        start = len(events)
    del events[:start]
