"""Issue #12 item 16: a KVBlockPool call with bad input changes nothing (validate, then mutate).

Before: ``free_blocks([1, 2, 0])`` freed 1 and 2 and then raised, leaving the counters
behind; ``free_blocks([-1])`` freed the last block (Python wraps negative indices), which
another request held, and the next allocation handed that block out twice.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.protocol.schema import to_dict


def _pool(n: int = 8, **kw) -> KVBlockPool:
    return KVBlockPool(n, 2, num_layers=2, kv_heads=1, head_dim=2, device="cpu", **kw)


def state(pool: KVBlockPool) -> dict:
    """Everything a call could change: the snapshot and the allocator's own state."""
    reqs = {
        r: (list(q.table), q.num_tokens, copy.copy(q.tokens), list(q.hashes), q.pending)
        for r, q in pool._requests.items()
    }
    return copy.deepcopy(
        {
            "stats": to_dict(pool.snapshot()),
            "refcount": list(pool._refcount),
            "free": list(pool._free),
            "cached": list(pool._cached),
            "reserve": list(pool._reserve),
            "h2b": dict(pool._hash_to_block),
            "fill": list(pool._fill),
            "requests": reqs,
            "leases": {k: list(v) for k, v in pool._leases.items()},
            "n_used": pool._n_used,
            "total": pool._total,
            "shrink": (pool._in_shrink, pool._target),
            "kv": [t.clone() for t in pool._kv],
        }
    )


def same(a: dict, b: dict) -> bool:
    kv_a, kv_b = a.pop("kv"), b.pop("kv")
    ok = a == b and all(torch.equal(x, y) for x, y in zip(kv_a, kv_b))
    a["kv"], b["kv"] = kv_a, kv_b
    return ok


def test_failed_free_blocks_frees_nothing_and_counters_stay_true() -> None:
    pool = _pool()
    raw = pool.alloc_blocks(2)
    assert raw == [1, 2]
    before = state(pool)
    for bad in ([1, 2, 0], [1, 2, 99], [1, 1], [2, -1], [1, 2.5]):
        with pytest.raises((ValueError, TypeError)):
            pool.free_blocks(bad)
        assert same(state(pool), before), bad
    pool.free_blocks(raw)
    s = pool.snapshot()
    assert s.allocated_blocks == 0 and s.allocs_total - s.frees_total == 0


def test_negative_or_foreign_ids_never_free_another_requests_block() -> None:
    pool = _pool(4, enable_prefix_caching=False)
    pool.allocate_prompt("victim", list(range(8)))  # all 4 blocks, the last one included
    victim = pool.block_table("victim")
    before = state(pool)
    for bad in ([-1], [victim[-1]], [victim[0]], [0]):
        with pytest.raises(ValueError):
            pool.free_blocks(bad)  # -1 used to wrap to the last block, the victim's
        assert same(state(pool), before), bad
    assert pool.alloc_blocks(1) is None  # nothing was freed: no block handed out twice


def test_every_mutating_method_refuses_bad_input_unchanged() -> None:
    pool = _pool(8)
    pool.allocate_prompt("a", [1, 2, 3])
    pool.allocate_prompt("b", [4, 5, 6, 7, 8])
    pool.finish("b", ["pd"])
    raw = pool.alloc_blocks(1)
    lease = pool.lease("a", pool.block_table("a")[:1])
    before = state(pool)
    k = torch.ones(2, 1, 2)
    calls = [
        lambda: pool.alloc_blocks(-1),
        lambda: pool.alloc_blocks(1.5),
        lambda: pool.try_to_reserve(-1),
        lambda: pool.try_to_reserve(0.5),
        lambda: pool.release_reserved(1.5),
        lambda: pool.resize(-1),
        lambda: pool.resize(2.5),  # below allocated: used to start a shrink to 2.5
        lambda: pool.resize("9"),
        lambda: pool.append_slots("a", 3.5),  # used to take blocks and then fail
        lambda: pool.append_slots("a", -1),
        lambda: pool.append_slots("a", 2, [1]),
        lambda: pool.append_slots("a", 2, [[1], [2]]),  # unhashable ids: used to fail late
        lambda: pool.append_slots("b", 1),  # deferred
        lambda: pool.append_slots("nope", 1),
        lambda: pool.allocate_prompt("a", [1]),
        lambda: pool.finish("nope"),
        lambda: pool.release("b", "offload"),
        lambda: pool.release("a", "pd"),
        lambda: pool.lease("a", [-1]),  # -1 wraps to a block of someone else
        lambda: pool.lease("a", [pool.block_table("a")[0], 99]),
        lambda: pool.lease("a", [pool.block_table("a")[0], pool.block_table("b")[0]]),
        lambda: pool.lease("nope", [1]),
        lambda: pool.release_lease(lease + 100),
        lambda: pool.free_blocks([*raw, -3]),
        lambda: pool.write_kv(0, pool.block_table("a"), k),  # K written, then "pass v"
        lambda: pool.write_kv(0, [-1], k, k),
        lambda: pool.write_kv(0, [1], torch.ones(5, 1, 2), torch.ones(5, 1, 2)),
    ]
    for i, call in enumerate(calls):
        with pytest.raises((ValueError, TypeError, KeyError)):
            call()
        assert same(state(pool), before), i
    # And valid calls still work afterwards.
    pool.release_lease(lease)
    pool.free_blocks(raw)
    assert pool.release("b", "pd") is True


def test_reads_refuse_ids_outside_the_pool() -> None:
    pool = _pool(4)
    with pytest.raises(ValueError):
        pool.read_kv(0, [-1], 2)
    with pytest.raises(ValueError):
        pool.read_kv(0, [1], 3)  # past the table
