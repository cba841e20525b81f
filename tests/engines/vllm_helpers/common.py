"""Shared by the vLLM helper scripts (run inside the vLLM env): the tiny model and the
environment, from kvsidecar.bench.vllm (pure Python, no vLLM import)."""

from kvsidecar.bench.vllm import TINY_LLAMA, engine_env, llm_kwargs, write_model

__all__ = ["TINY_LLAMA", "engine_env", "llm_kwargs", "recount_pool", "write_model"]


def recount_pool(sched, pool) -> tuple[dict, list, dict[str, int]]:
    """The brute-force oracle of one BlockPool, from vLLM's own objects: its state fields,
    the finished requests still in ``Scheduler.requests`` (deferred by a connector), and
    how many distinct non-null blocks of this pool each deferred request holds (only those
    holding one: schema.md's one rule for every source)."""
    blocks = [b for b in pool.blocks if not b.is_null]
    managers = [
        m for m in sched.kv_cache_manager.coordinator.single_type_managers if m.block_pool is pool
    ]
    deferred = [r for r in sched.requests.values() if r.is_finished()]
    held: set[int] = set()
    blocks_of: dict[str, int] = {}
    for r in deferred:
        ids = {
            b.block_id
            for m in managers
            for b in m.req_to_blocks.get(r.request_id, ())
            if not b.is_null
        }
        if ids:
            held |= ids
            blocks_of[r.request_id] = len(ids)
    fields = {
        "total_blocks": len(blocks),
        "allocated_blocks": sum(b.ref_cnt > 0 for b in blocks),
        "available_blocks": sum(b.ref_cnt == 0 for b in blocks),
        "cached_blocks": sum(b.ref_cnt == 0 and b.block_hash is not None for b in blocks),
        "deferred_free_requests": len(blocks_of),
        "deferred_free_blocks": len(held),
    }
    return fields, deferred, blocks_of
