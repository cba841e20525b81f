"""Shared by the vLLM helper scripts (run inside the vLLM env): the tiny model and the
environment, from kvsidecar.bench.vllm (pure Python, no vLLM import)."""

from kvsidecar.bench.vllm import TINY_LLAMA, engine_env, llm_kwargs, write_model

__all__ = [
    "TINY_LLAMA",
    "engine_env",
    "llm_kwargs",
    "plan_kv_cache",
    "planner",
    "plugin_scheduler",
    "recount_pool",
    "write_model",
]


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


def planner():
    """vLLM's planner functions (0.33 moved some out of kv_cache_utils)."""
    from vllm.v1.core import kv_cache_utils

    try:
        from vllm.v1.core import kv_cache_planning
    except ImportError:
        kv_cache_planning = kv_cache_utils
    names = (
        "get_kv_cache_groups",
        "get_kv_cache_config_from_groups",
        "generate_scheduler_kv_cache_config",
    )
    return [getattr(kv_cache_planning, n, None) or getattr(kv_cache_utils, n) for n in names]


def plan_kv_cache(vllm_config, specs: dict, memory: int):
    """The scheduler's KVCacheConfig for these layer specs, as vLLM's engine core plans it:
    groups, one backing allocation the groups overlay (``KVCacheTensor.size`` repeated per
    group), the scheduler's copy."""
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    get_groups, from_groups, for_scheduler = planner()
    register_all_kvcache_specs(vllm_config)
    groups = get_groups(vllm_config, specs)
    return for_scheduler([from_groups(vllm_config, groups, memory)])


def plugin_scheduler(vllm_config, kv_cache_config, block_size: int):
    """The scheduler the engine core builds, with the plugin applied as there: through
    ``register()`` and ``SchedulerConfig.get_scheduler_cls()``."""
    from vllm.v1.structured_output import StructuredOutputManager

    from kvsidecar.agent.engines import vllm as plugin

    plugin.register()
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )
