"""vLLM's KV-event wire, as vLLM 0.32's ``vllm/distributed/kv_events.py`` defines it.

Same msgspec struct names, field names, field order and options (``tag=True``,
``omit_defaults``, ``array_like`` batch), so msgspec encodes byte-for-byte what vLLM's
own publisher sends and vLLM's own decoder reads it (tests/streams/ checks with vLLM's
classes). Never imports vLLM. Fields vLLM 0.33 added (``lookahead_token_ids``) have
defaults and are omitted, as vLLM 0.33 omits them when unset.

Frames: ``(topic, seq as 8-byte big-endian, msgpack EventBatch)``; replay over a ROUTER:
a DEALER sends ``(b"", start seq 8-byte big-endian)``, the answer is
``(b"", topic, seq, payload)`` per buffered batch, then ``(b"", b"", -1, b"")``.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (tagged: ``type`` is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule (``ZmqEventPublisher.offset_endpoint_port``): a tcp port + the DP rank
    (port 0 is left to the OS), ``inproc://x`` -> ``inproc://x_dp<r>``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            last = endpoint.rfind(":")
            port = int(endpoint[last + 1 :])
            if port == 0:
                return endpoint
            return f"{endpoint[:last]}:{port + data_parallel_rank}"
        return endpoint
    raise ValueError(f"invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp'")


def uses_signed_hashes(events_segment: str) -> bool:
    """Whether a KV-event segment's hashes go out signed: SGLang's (``kvevents.sglang.*``,
    the engine field of the segment's name). SGLang's own publisher sends each hash as a
    signed 64-bit int (``hash_str_to_int64``); the segment keeps the same 64 bits
    unsigned, vLLM's form."""
    return events_segment.startswith("kvevents.sglang.")


def signed_hash(h: int) -> int:
    """An unsigned 64-bit hash as SGLang sends it: the same 64 bits as a signed int."""
    return h - (1 << 64) if h >= 1 << 63 else h


def signed_hashes(events: list[Any]) -> None:
    """The hashes of these events (fresh, not yet encoded) as signed 64-bit ints, in place."""
    signed = signed_hash
    for e in events:
        hashes = getattr(e, "block_hashes", None)
        if hashes:
            e.block_hashes = [signed(h) for h in hashes]
        parent = getattr(e, "parent_block_hash", None)
        if parent is not None:
            e.parent_block_hash = signed(parent)
