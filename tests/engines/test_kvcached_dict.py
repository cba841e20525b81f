"""PoolSource seam and the kvcached dict adapter (dicts shaped like observability.py's)."""

from __future__ import annotations

from kvsidecar.agent.adapters import PoolSource
from kvsidecar.agent.engines.kvcached import (
    PAGE_FIELDS,
    KvcachedDictAdapter,
    apply_page_fields,
    from_kvcached_dict,
    page_fields,
)
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.protocol.schema import KVCachePoolSnapshot
from tests.engines.kvcached_helpers.fields import EQUAL

MIB = 1 << 20


def kvcached_dict(**over) -> dict:
    """What kvcached's KVCacheManager.observability_snapshot_dict() returns (v1)."""
    block_mem = 16 * 8 * 128 * 2  # block_size 16 tokens x cell size
    d = {
        "schema_version": "kvcached.observability.v1",
        "pool_type": "kv_cache",
        "integration": "vllm",
        "pool_name": "block_pool",
        "group_id": 0,
        "num_layers": 32,
        "num_kv_buffers": 2,
        "page_size_bytes": 2 * MIB,
        "block_size_bytes": block_mem,
        "total_blocks": 1000,
        "available_blocks": 700,
        "allocated_blocks": 300,
        "reserved_blocks": 4,
        "available_bytes": 700 * block_mem * 64,
        "allocated_bytes": 300 * block_mem * 64,
        "reserved_bytes": 4 * block_mem * 64,
        "null_block_reserved": True,
        "virtual_per_layer_bytes": 1000 * block_mem * 2,
        "virtual_total_bytes": 1000 * block_mem * 2 * 32,
        "mapped_bytes": 20 * 2 * MIB * 64,
        "total_pages": 64,
        "free_pages": 44,
        "inuse_pages": 20,
        "reserved_pages": 5,
        "available_physical_pages": 40,
        "effective_free_pages": 44,
        "in_shrink": False,
        "shrink_target_blocks": None,
        "resize_target_bytes": -1,
    }
    d.update(over)
    return d


def test_kvblockpool_is_a_pool_source():
    pool = KVBlockPool(4, 2, num_layers=1, kv_heads=1, head_dim=2, device="cpu")
    assert isinstance(pool, PoolSource)
    src: PoolSource = pool
    assert isinstance(src.snapshot(), KVCachePoolSnapshot)


def test_kvcached_dict_maps_every_shared_field():
    d = kvcached_dict()
    adapter = KvcachedDictAdapter(lambda: d)
    assert isinstance(adapter, PoolSource)
    s = adapter.snapshot()
    for name in EQUAL:
        assert getattr(s, name) == d[name], name
    assert s.resize_target_bytes is None  # -1 means no target
    assert s.shrink_target_blocks is None
    # kvcached's total_blocks is its initial reservation, null block included.
    assert s.virtual_blocks == 1000
    # Ours: current capacity and allocated blocks without the null block.
    assert s.total_blocks == 999 and s.allocated_blocks == 299
    assert s.allocated_bytes == 299 * d["block_size_bytes"] * 32 * 2
    # kvcached has no such counters: schema defaults.
    assert s.cached_blocks is None and s.allocs_total is None and s.block_size_tokens == 0
    assert s.deferred_free_blocks is None and s.tokens_used is None  # unsupported, not 0


def test_kvcached_shrink_and_resize_target():
    s = from_kvcached_dict(
        kvcached_dict(in_shrink=True, shrink_target_blocks=250, resize_target_bytes=512 * MIB)
    )
    assert s.in_shrink is True
    assert s.shrink_target_blocks == 249  # kvcached's target counts the null block
    assert s.resize_target_bytes == 512 * MIB


def test_kvcached_capacity_follows_a_resize_of_its_pages():
    # PageAllocator.resize shrank the pages to 10; kvcached's total_blocks stays 1000.
    s = from_kvcached_dict(kvcached_dict(total_pages=10, free_pages=2, inuse_pages=8))
    assert s.virtual_blocks == 1000
    assert s.total_blocks == 10 * 64 - 1
    no_null = from_kvcached_dict(kvcached_dict(null_block_reserved=False))
    assert no_null.total_blocks == 1000 and no_null.allocated_blocks == 300


def test_kvcached_counters_follow_its_capability_record():
    d = kvcached_dict(allocs_total=12, frees_total=5)
    caps = {"features": {"operation_counters": False}, "operation_counter_names": []}
    assert from_kvcached_dict(d, capabilities=caps).allocs_total is None
    assert from_kvcached_dict(d).allocs_total is None  # no record: unsupported
    caps = {"features": {"operation_counters": True}, "operation_counter_names": ["allocs_total"]}
    s = from_kvcached_dict(d, capabilities=caps)
    assert s.allocs_total == 12 and s.frees_total is None  # named ones only


def test_page_fields_for_a_plugin_record():
    fields = page_fields(kvcached_dict())
    assert set(fields) == set(PAGE_FIELDS)
    rec = KVCachePoolSnapshot(total_blocks=5)
    apply_page_fields(rec, fields)
    assert rec.page_size_bytes == 2 * MIB and rec.effective_free_pages == 44
    assert rec.virtual_blocks == 1000 and rec.resize_target_bytes is None
    assert rec.total_blocks == 5  # block fields stay the plugin's


def test_kvcached_missing_unknown_and_odd_values():
    d = {
        "pool_name": None,  # Optional in kvcached
        "num_layers": 24,
        "available_blocks": -127,  # #436: an unlocked read went negative
        "lifecycle_phase": "ready",  # a later optional key we do not know
        "num_kv_buffers": 1,
    }
    s = KvcachedDictAdapter(lambda: d, pool_name="mla").snapshot()
    assert s.pool_name == "mla"
    assert s.num_layers == 24 and s.num_kv_buffers == 1
    assert s.available_blocks == 0
    assert s.total_pages is None and s.null_block_reserved is None
    assert s.integration is None and s.resize_target_bytes is None
    assert s.in_shrink is False
    empty = from_kvcached_dict({})
    assert empty.pool_name == "block_pool" and empty.num_kv_buffers == 2
    assert empty.total_blocks == 0


def test_adapter_calls_source_every_time():
    state = {"allocated_blocks": 1}
    adapter = KvcachedDictAdapter(lambda: dict(state))
    assert adapter.snapshot().allocated_blocks == 1
    state["allocated_blocks"] = 7
    assert adapter.snapshot().allocated_blocks == 7
