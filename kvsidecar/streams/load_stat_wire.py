"""SGLang's ``LoadStat`` wire, as SGLang 0.5.23's
``sglang/srt/managers/scheduler_components/load_publisher.py`` defines it.

The same msgspec struct (name, field names, order, options: ``tag=True``, ``array_like``,
no ``omit_defaults``), so msgspec encodes byte for byte what SGLang's own publisher sends:
``["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens, max_total_num_tokens,
attn_dp_rank, num_waiting_uncached_tokens, num_total_tokens, max_running_requests,
total_prefill_uncached_tokens, total_prefill_busy_us]``. Frames as its KV-event socket's:
``(b"load", seq as 8-byte big-endian, msgpack LoadStat)``, seq from 0 per socket. Never
imports SGLang (tests/streams/ checks the bytes against SGLang's own class).

`load_stat` builds one from a kvsidecar snapshot, for every engine kvsidecar reads; which
fields are exact for which engine: docs/load-push.md.
"""

from __future__ import annotations

import msgspec

from kvsidecar.protocol.schema import KVCachePoolSnapshot, Snapshot

LOAD_TOPIC = b"load"  # SGLang's LOAD_TOPIC (sglang/srt/disaggregation/kv_events.py)


class LoadStat(msgspec.Struct, array_like=True, gc=False, tag=True):
    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int  # KV tokens in use
    max_total_num_tokens: int  # KV capacity; 0 when unknown
    attn_dp_rank: int | None = None
    # Appended by SGLang after its #34608 prefix; kvsidecar has none of them: 0 (the
    # struct's own default, what SGLang sends where it has nothing to count).
    num_waiting_uncached_tokens: int = 0
    num_total_tokens: int = 0
    max_running_requests: int = 0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0


_encoder = msgspec.msgpack.Encoder()


def encode(stat: LoadStat) -> bytes:
    return _encoder.encode(stat)


def _sized(pools: list[KVCachePoolSnapshot]) -> list[KVCachePoolSnapshot]:
    return [
        p
        for p in pools
        if p.total_blocks and p.allocated_blocks is not None and p.block_size_tokens
    ]


def _used(p: KVCachePoolSnapshot, engine: str) -> int:
    """Blocks in use as the engine's own usage counts them (docs/gateway.md): capacity less
    what is allocatable now (free + evictable cached: SGLang's and vLLM's formula), or the
    allocated blocks where the engine counts those (ATOM) or nothing else is known."""
    if engine != "atom" and p.available_blocks is not None:
        return max(0, p.total_blocks - p.available_blocks)
    return p.allocated_blocks


def kv_tokens(snapshot: Snapshot) -> tuple[int, int]:
    """(num_tokens, max_total_num_tokens): KV tokens in use and the capacity, in tokens.
    SGLang: its fullest pool (``get_kv_token_stats``: one pool but for hybrid models);
    other engines: their pools summed (vLLM's one BlockPool); (0, 0) with no sized pool."""
    engine = snapshot.runtime.engine
    sized = _sized(snapshot.pools)
    if not sized:
        return 0, 0
    if engine == "sglang":
        p = max(sized, key=lambda p: _used(p, engine) / p.total_blocks)
        return _used(p, engine) * p.block_size_tokens, p.total_blocks * p.block_size_tokens
    used = sum(_used(p, engine) * p.block_size_tokens for p in sized)
    return used, sum(p.total_blocks * p.block_size_tokens for p in sized)


def load_stat(snapshot: Snapshot) -> LoadStat:
    """The LoadStat of one rank's snapshot."""
    rt = snapshot.runtime
    tokens, capacity = kv_tokens(snapshot)
    return LoadStat(
        num_running_reqs=rt.requests_running or 0,
        num_waiting_reqs=rt.requests_waiting or 0,
        num_tokens=tokens,
        max_total_num_tokens=capacity,
        attn_dp_rank=rt.dp_rank,
    )
