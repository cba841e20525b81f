"""Targeted tests of KVBlockPool: deferred free, real K/V storage, failures, LRU, resize."""

from __future__ import annotations

from array import array

import pytest
import torch

from kvsidecar.agent.bench.pool import bench_alloc_free
from kvsidecar.agent.pool import (
    DeviceMemorySampler,
    KVBlockPool,
    default_device,
    sample_device_memory,
)
from kvsidecar.protocol.schema import RuntimeSnapshot, Snapshot, decode_snapshot, encode_snapshot

BS = 4


def make_pool(num_blocks: int = 16, **kw) -> KVBlockPool:
    kw.setdefault("num_layers", 2)
    kw.setdefault("kv_heads", 2)
    kw.setdefault("head_dim", 8)
    kw.setdefault("device", "cpu")
    return KVBlockPool(num_blocks, BS, **kw)


def deferred_mask_count(pool: KVBlockPool, req_ids, kind: str) -> int:
    """ATOM's physical_block_count: one boolean mask over the pool from the block tables."""
    mask = torch.zeros(pool.storage_rows, dtype=torch.bool)
    for rid in req_ids:
        table = pool.block_table(rid, kind)
        if isinstance(table, array):
            t = torch.frombuffer(table, dtype=torch.int32).long()
        else:
            t = torch.as_tensor(table, dtype=torch.long)
        mask[t] = True
    return int(mask.sum())


@pytest.mark.parametrize("kind", ["list", "array", "tensor"])
def test_deferred_shared_blocks_counted_once_and_leases_not_counted(kind):
    pool = make_pool()
    prefix = list(range(100, 108))  # two full blocks
    assert pool.allocate_prompt("a", [*prefix, 1, 2]) == 0
    assert pool.allocate_prompt("b", [*prefix, 3]) == 2
    assert pool.allocate_prompt("live", [*prefix, 4, 5, 6]) == 2
    shared = pool.block_table("a")[:2]
    assert pool.block_table("b")[:2] == shared == pool.block_table("live")[:2]

    assert pool.finish("a", connectors=["pd"]) is True
    assert pool.abort("b", connectors=["pd", "offload"]) is True
    s = pool.snapshot()
    # 2 shared + a's tail + b's tail; the live request's private tail is not deferred.
    assert s.deferred_free_requests == 2
    assert s.deferred_free_blocks == 4 == deferred_mask_count(pool, ["a", "b"], kind)
    assert s.allocated_blocks == 5

    # An early-release lease on the live request's blocks is not deferred.
    lease = pool.lease("live", pool.block_table("live", kind))
    pool.finish("live")
    assert pool.snapshot().deferred_free_blocks == 4
    assert pool.snapshot().allocated_blocks == 5  # live's tail is held by the lease only
    pool.release_lease(lease)
    assert pool.snapshot().allocated_blocks == 4

    assert pool.release("a", "pd") is True
    s = pool.snapshot()
    assert (s.deferred_free_requests, s.deferred_free_blocks) == (1, 3)
    assert pool.release("b", "offload") is False  # still waiting on pd
    assert pool.snapshot().deferred_free_blocks == 3
    assert pool.release("b", "pd") is True
    s = pool.snapshot()
    assert (s.deferred_free_requests, s.deferred_free_blocks, s.allocated_blocks) == (0, 0, 0)
    assert s.cached_blocks == 2  # the shared full blocks stay cached
    assert s.allocs_total == s.frees_total


def test_release_errors():
    pool = make_pool()
    with pytest.raises(ValueError):
        pool.alloc_blocks(-1)
    with pytest.raises(ValueError):
        pool.free_blocks([0])  # the null block is never allocated
    pool.allocate_prompt("a", [1, 2, 3])
    with pytest.raises(ValueError):
        pool.allocate_prompt("a", [1])  # duplicate id
    with pytest.raises(ValueError):
        pool.release("a", "pd")  # not deferred
    pool.finish("a", "pd")  # a bare string is one connector
    assert pool.pending_connectors("a") == {"pd"}
    with pytest.raises(KeyError):
        pool.release("a", "offload")
    with pytest.raises(ValueError):
        pool.append_slots("a", 1)  # finished
    with pytest.raises(ValueError):
        pool.lease("a", [0])  # the null block is nobody's


@pytest.mark.parametrize(
    "connectors", ["", "   ", ["pd", ""], ("pd", "\t"), [None], ["pd", 7]], ids=repr
)
@pytest.mark.parametrize("how", ["finish", "abort"])
def test_empty_or_blank_connector_name_is_refused_and_changes_nothing(how, connectors):
    """Issue 41 item 8b: ``finish(r, connectors="")`` deferred the request on a connector
    named "" (so its blocks waited for ``release(r, "")``). An empty, blank or non-string
    name is refused before anything changes; the request is still live and finishes."""
    pool = make_pool()
    pool.allocate_prompt("r", [1, 2, 3, 4, 5, 6])
    before = pool.snapshot()
    allocated, running = before.allocated_blocks, pool.num_running
    with pytest.raises(ValueError, match="not a name"):
        getattr(pool, how)("r", connectors=connectors)
    s = pool.snapshot()
    assert not pool.is_deferred("r") and pool.pending_connectors("r") == frozenset()
    assert (s.deferred_free_requests, s.deferred_free_blocks) == (0, 0)
    assert (s.allocated_blocks, pool.num_running) == (allocated, running) == (2, 1)
    pool.append_slots("r", 1)  # still live
    assert pool.finish("r") is False
    assert pool.snapshot().allocated_blocks == 0
    with pytest.raises(KeyError):
        pool.block_table("r")


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_kv_buffers", [2, 1])
def test_kv_values_round_trip_through_shared_prefix(num_kv_buffers, device):
    pool = make_pool(num_kv_buffers=num_kv_buffers, dtype=torch.float32, device=device)
    assert pool.kv_cache(0).device.type == device
    assert pool.kv_cache(0).shape == (num_kv_buffers, 17, BS, 2, 8)
    prompt = list(range(50, 60))  # 2 full blocks + 2 tokens
    pool.allocate_prompt("writer", prompt)
    g = torch.Generator().manual_seed(0)
    n = len(prompt)
    k = torch.randn(n, 2, 8, generator=g).to(device)
    v = torch.randn(n, 2, 8, generator=g).to(device) if num_kv_buffers == 2 else None
    for layer in range(pool.num_layers):
        pool.write_kv(
            layer, pool.block_table("writer", "array"), k + layer, None if v is None else v - layer
        )

    # The reader shares the 2 full blocks through the prefix cache, not by copy.
    assert pool.allocate_prompt("reader", [*prompt[:8], 7, 7]) == 2
    rt = pool.block_table("reader", "tensor")
    assert rt[:2].tolist() == pool.block_table("writer")[:2]
    for layer in range(pool.num_layers):
        rk, rv = pool.read_kv(layer, rt, 8)
        assert torch.equal(rk, k[:8] + layer)
        if v is None:
            assert rv is None
        else:
            assert torch.equal(rv, v[:8] - layer)
        # Raw storage check: block table row -> the same tensor rows.
        cache = pool.kv_cache(layer)
        assert torch.equal(cache[0, rt[0]], k[:BS] + layer)
    # Not shared: the reader's third block is its own.
    assert pool.block_table("reader")[2] != pool.block_table("writer")[2]

    # After the writer finishes, the cached blocks still hold the values for a new reader.
    pool.finish("writer")
    pool.finish("reader")
    assert pool.allocate_prompt("late", prompt[:8]) == 2
    rk, _ = pool.read_kv(0, pool.block_table("late"), 8)
    assert torch.equal(rk, k[:8])


def test_alloc_failure_counted_and_nothing_negative():
    pool = make_pool(num_blocks=4)
    assert pool.allocate_prompt("a", list(range(12))) == 0  # 3 blocks
    assert pool.allocate_prompt("b", list(range(100, 108))) is None  # needs 2, 1 left
    s = pool.snapshot()
    assert s.alloc_failures_total == 1
    assert (s.allocated_blocks, s.available_blocks) == (3, 1)
    assert pool.append_slots("a", 5) is False  # needs 2 more blocks
    assert pool.alloc_blocks(2) is None
    assert pool.try_to_reserve(2) is False
    s = pool.snapshot()
    assert s.alloc_failures_total == 4
    assert s.allocated_blocks == 3 and s.tokens_used == 12 and s.available_blocks == 1
    assert pool.append_slots("a", 4) is True
    s = pool.snapshot()
    assert (s.allocated_blocks, s.available_blocks, s.available_bytes) == (4, 0, 0)
    assert pool.alloc_blocks(1) is None
    # Shrink below allocated: available stays at 0, never negative.
    assert pool.resize(1) is False
    s = pool.snapshot()
    assert s.in_shrink and s.shrink_target_blocks == 1 and s.total_blocks == 4
    assert s.available_blocks == 0
    for f in s.__struct_fields__:
        value = getattr(s, f)
        if isinstance(value, int) and not isinstance(value, bool):
            assert value >= 0, f


def test_eviction_is_lru():
    pool = make_pool(num_blocks=4)
    for i in range(4):  # four one-block requests, each full and hashed
        pool.allocate_prompt(f"r{i}", [i] * BS)
    ids = [pool.block_table(f"r{i}")[0] for i in range(4)]
    for i in (2, 0, 3, 1):  # free order = LRU order
        pool.finish(f"r{i}")
    assert pool.snapshot().cached_blocks == 4
    # Touch r0's block: a prefix hit revives it, then it is freed as most recent.
    assert pool.allocate_prompt("again", [0] * BS) == 1
    pool.finish("again")
    # LRU order is now r2, r3, r1, r0: two fresh blocks evict r2 then r3.
    assert pool.allocate_prompt("new", list(range(1000, 1000 + 2 * BS))) == 0
    assert sorted(pool.block_table("new")) == sorted([ids[2], ids[3]])
    s = pool.snapshot()
    assert s.evictions_total == 2 and s.cached_blocks == 2
    assert pool.allocate_prompt("hit1", [1] * BS) == 1  # still cached
    assert pool.block_table("hit1") == [ids[1]]
    assert pool.allocate_prompt("miss2", [2] * BS) == 0  # evicted: a miss, takes r0's block
    assert pool.block_table("miss2") == [ids[0]]
    assert pool.allocate_prompt("full", [9]) is None
    s = pool.snapshot()
    assert (s.evictions_total, s.cached_blocks, s.available_blocks) == (3, 0, 0)
    assert (s.prefix_hits_total, s.alloc_failures_total) == (2, 1)


def test_decode_tail_blocks_evicted_before_shared_prefix():
    pool = make_pool(num_blocks=3)
    pool.allocate_prompt("a", list(range(2 * BS)))
    prefix_id, tail_id = pool.block_table("a")
    pool.finish("a")  # frees tail first, so the tail is the LRU block
    assert pool.allocate_prompt("x", list(range(500, 500 + 2 * BS))) == 0
    assert tail_id in pool.block_table("x") and prefix_id not in pool.block_table("x")


def test_reserve_ledger_is_allocated_and_available_and_drained_first():
    pool = make_pool(num_blocks=8)
    assert pool.try_to_reserve(3) is True
    s = pool.snapshot()
    assert (s.allocated_blocks, s.reserved_blocks, s.available_blocks) == (3, 3, 8)
    held = list(pool._reserve)
    pool.allocate_prompt("a", list(range(2 * BS)))
    assert set(pool.block_table("a")) <= set(held)
    s = pool.snapshot()
    assert (s.allocated_blocks, s.reserved_blocks, s.available_blocks) == (3, 1, 6)
    assert s.allocs_total == 3  # draining the ledger hands out nothing new
    assert pool.release_reserved(5) == 1
    assert pool.snapshot().allocated_blocks == 2


def test_resize_grow_keeps_data_and_shrink_completes_on_free():
    pool = make_pool(num_blocks=4, dtype=torch.float32)
    pool.allocate_prompt("a", list(range(3 * BS)))
    k = torch.arange(3 * BS * 16, dtype=torch.float32).view(3 * BS, 2, 8)
    pool.write_kv(0, pool.block_table("a"), k, -k)
    mapped = pool.snapshot().mapped_bytes
    assert pool.resize(10) is True
    s = pool.snapshot()
    assert s.total_blocks == 10 and pool.kv_cache(0).shape[1] == 11
    assert s.mapped_bytes == mapped * 11 // 5
    # The reservation (storage rows, null block included), not the capacity (v1.2).
    assert s.virtual_blocks == 11
    assert s.virtual_per_layer_bytes == 11 * s.block_size_bytes * 2
    assert torch.equal(pool.read_kv(0, pool.block_table("a"), 3 * BS)[1], -k)

    pool.allocate_prompt("b", list(range(900, 900 + 2 * BS)))
    assert pool.resize(3) is False  # 5 allocated
    s = pool.snapshot()
    assert s.in_shrink and s.shrink_target_blocks == 3 and s.available_blocks == 0
    assert pool.allocate_prompt("c", [1]) is None  # no growth while shrinking
    pool.finish("b")
    s = pool.snapshot()
    assert s.in_shrink is False and s.total_blocks == 3 and s.shrink_target_blocks is None
    assert s.cached_blocks == 0 and s.evictions_total == 2  # b's cached blocks did not fit
    assert s.mapped_bytes == mapped * 11 // 5  # storage is not given back
    assert s.available_blocks == 0 and s.allocated_blocks == 3


def test_snapshot_is_live_record_and_encodes():
    pool = make_pool(pool_name="mha", group_id=1)
    snap = pool.snapshot()
    assert snap is pool.stats is pool.snapshot()
    pool.allocate_prompt("a", [1, 2, 3, 4, 5])
    assert snap.allocated_blocks == 2 and snap.tokens_used == 5
    assert snap.block_size_bytes == BS * 2 * 8 * 2
    assert snap.allocated_bytes == 2 * snap.block_size_bytes * 2 * 2
    out = decode_snapshot(encode_snapshot(Snapshot(runtime=RuntimeSnapshot(), pools=[snap])))
    assert out.pools[0] == snap and out.pools[0].pool_name == "mha"


def test_table_kinds_accepted():
    pool = make_pool()
    pool.allocate_prompt("a", torch.arange(10, dtype=torch.int32))
    assert pool.allocate_prompt("b", array("i", range(9))) == 2
    pool.append_slots("b", 3, torch.tensor([1, 2, 3]))
    lid = pool.lease("b", pool.block_table("b", "tensor")[:2])
    pool.free_blocks(array("i", pool.alloc_blocks(2)))
    pool.release_lease(lid)
    assert isinstance(pool.block_table("a", "array"), array)
    assert pool.block_table("a", "tensor").dtype == torch.int32


@pytest.mark.parametrize("device", DEVICES)
def test_default_device_and_memory_sampler(device):
    assert make_pool(device=None).device == default_device()
    now = [0.0]
    sampler = DeviceMemorySampler(device, clock=lambda: now[0])
    total, free = sampler.sample()
    assert total > 0 and 0 <= free <= total
    for _ in range(100):
        sampler.sample()
    assert sampler.reads == 1
    now[0] = 0.2
    sampler.sample()
    assert sampler.reads == 2
    assert sample_device_memory(device)[0] == total


def test_bench_alloc_free():
    r = bench_alloc_free(64, 20)
    assert r["alloc_ns_per_block_median"] > 0 and r["free_ns_per_block_median"] > 0
