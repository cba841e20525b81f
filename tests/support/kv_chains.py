"""The KV-event segment content the stream's memory and stall tests publish."""

from __future__ import annotations

from kvsidecar.protocol.kv_events_writer import KVEventsWriter

CHAIN = 64  # blocks per chain: block i's parent is i - 1 within one
TOKENS = list(range(16))  # each block's token ids (block_size 16)


def store_chains(w: KVEventsWriter, blocks: int) -> None:
    """Blocks 0..blocks-1 stored (hash i + 1 in slot i) in chains of CHAIN blocks."""
    for i in range(blocks):
        w.stored(i, i + 1, i if i % CHAIN else None, TOKENS)
