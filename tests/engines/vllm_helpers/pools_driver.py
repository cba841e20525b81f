"""The bytes of each vLLM ``BlockPool``, on KV-cache configs that vLLM's own planner builds
(``get_kv_cache_groups`` + ``get_kv_cache_config_from_groups`` +
``generate_scheduler_kv_cache_config``, as the engine core does), with the plugin applied
through ``register()`` and ``SchedulerConfig.get_scheduler_cls()``, no model:

* ``plain``: four full-attention layers, one group, one pool;
* ``hybrid``: two full-attention and four sliding-window layers (gemma-like), three groups
  that vLLM overlays on one storage (one pool), layer-outer (LBHNC);
* ``hybrid-1-5``: one full and five sliding-window layers, six groups, block-outer (BLHNC);
* ``hisparse``: sparse MLA with vLLM's ``HiSparseConnector``: a host pool of its own
  (``SharedEventQueueBlockPool``, host-resident tensors) beside the device pool.

For each pool it reports the published record and vLLM's own figures (the pool's blocks,
the backing allocations of its groups' layers), after a few requests were scheduled and a
step completed. Run by tests/engines/test_vllm_pools.py in each vLLM env:

    python pools_driver.py SHM_DIR
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import plan_kv_cache, plugin_scheduler, write_model

CONFIGS = ("plain", "hybrid", "hybrid-1-5", "hisparse")


def build(name: str, model_dir: str):
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        SparseCacheRole,
    )

    block = 64 if name == "hisparse" else 16
    sched_cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    model = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True)
    vc = VllmConfig(
        scheduler_config=sched_cfg, model_config=model, cache_config=CacheConfig(block_size=block)
    )
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    dtype = torch.float32
    if name == "hisparse":
        from vllm.config.attention import HiSparseConfig

        # Set after construction: VllmConfig refuses HiSparse off CUDA, but the scheduler
        # side (planner, coordinator, connector, pools) is plain Python.
        vc.kv_transfer_config = KVTransferConfig(
            kv_connector="HiSparseConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"host_pool_gib": 0.001},
        )
        vc.attention_config.hisparse_config = HiSparseConfig()
        vc.model_config.hf_config.index_topk = 64
        vc.cache_config.kv_cache_layout = "BLHNC"  # HiSparseConnector's required layout
        sparse = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=32, dtype=dtype)
        index = MLAAttentionSpec(
            block_size=block,
            num_kv_heads=1,
            head_size=16,
            dtype=dtype,
            cache_role=SparseCacheRole.INDEXER,
        )
        specs = {f"layers.{i}.attn": sparse for i in range(2)}
        specs.update({f"layers.{i}.indexer": index for i in range(2)})
        memory = 64 * 4096
    else:
        full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=8, dtype=dtype)
        swa = SlidingWindowSpec(
            block_size=block, num_kv_heads=2, head_size=8, dtype=dtype, sliding_window=64
        )
        n_full, n_swa, layout = {
            "plain": (4, 0, "LBHNC"),
            "hybrid": (2, 4, "LBHNC"),
            "hybrid-1-5": (1, 5, "BLHNC"),
        }[name]
        vc.cache_config.kv_cache_layout = layout
        specs = {f"layers.{i}": full if i < n_full else swa for i in range(n_full + n_swa)}
        memory = 96 * full.page_size_bytes * max(n_full, 2)
    kv_cache_config = plan_kv_cache(vc, specs, memory)
    vc.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return plugin_scheduler(vc, kv_cache_config, block), kv_cache_config, block


def step(sched, block: int) -> int:
    """Three requests scheduled and one step completed: blocks in use. Returns how many."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(block, sha256)
    for i in range(3):
        sched.add_request(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=[3 + i + 7 * t for t in range(40 + 10 * i)],
                sampling_params=SamplingParams(max_tokens=8, ignore_eos=True),
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[5] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        ),
    )
    return len(ids)


def pools_of(sched) -> list:
    """Distinct BlockPools, the manager's own first (the plugin's order)."""
    manager = sched.kv_cache_manager
    pools = [manager.block_pool]
    for m in manager.coordinator.single_type_managers:
        if all(m.block_pool is not p for p in pools):
            pools.append(m.block_pool)
    return pools


def run(name: str, model_dir: str) -> dict:
    from kvsidecar.protocol.reader import SegmentReader

    sched, cfg, block = build(name, model_dir)
    sidecar = sched._kvsidecar
    if sidecar is None:
        raise SystemExit(f"plugin not active: scheduler is {type(sched).__name__}")
    scheduled = step(sched, block)
    reader = SegmentReader(path=sidecar.agent.segment_path)
    err = reader.attach()
    if err is not None:
        raise SystemExit(f"attach: {err}")
    records = reader.read().snapshot.pools
    # vLLM's own figures: every tensor of one residency lies in one backing allocation
    # of `size` bytes (vllm/v1/worker/utils.py allocate_kv_cache asserts one size; the
    # HiSparse host pool is allocated apart, hisparse/binding.py).
    backings = {str(t.host_resident): t.size for t in cfg.kv_cache_tensors}
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    pools = []
    for pool, rec in zip(pools_of(sched), records):
        own = [g for m, g in zip(managers, cfg.kv_cache_groups) if m.block_pool is pool]
        names = {n for g in own for n in g.layer_names}
        placed = {
            str(t.host_resident): t.size for t in cfg.kv_cache_tensors if names & set(t.layers)
        }
        pools.append(
            {
                "pool_name": rec.pool_name,
                "manager_pool": pool is sched.kv_cache_manager.block_pool,
                "num_gpu_blocks": pool.num_gpu_blocks,
                "groups": len(own),
                "host": type(pool).__name__ != "BlockPool",
                "backing_bytes": sum(placed.values()),
                "allocated_in_vllm": sum(b.ref_cnt > 0 for b in pool.blocks if not b.is_null),
                **{
                    k: getattr(rec, k)
                    for k in (
                        "num_layers",
                        "num_kv_buffers",
                        "block_size_bytes",
                        "total_blocks",
                        "virtual_blocks",
                        "virtual_per_layer_bytes",
                        "virtual_total_bytes",
                        "mapped_bytes",
                        "allocated_blocks",
                        "allocated_bytes",
                        "available_bytes",
                        "prefix_query_tokens_total",
                    )
                },
            }
        )
    result = {
        "config": name,
        "vllm": reader.read().snapshot.runtime.engine_version,
        "kv_cache_groups": len(cfg.kv_cache_groups),
        "kv_cache_tensors": len(cfg.kv_cache_tensors),
        "tensor_sizes_summed": sum(t.size for t in cfg.kv_cache_tensors),
        "backings": backings,
        "scheduled": scheduled,
        "pool_records": len(records),
        "pools": pools,
    }
    sched.shutdown()
    reader.close()
    return result


def main() -> int:
    os.environ["KVSIDECAR_SHM_DIR"] = sys.argv[1]
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    model_dir = write_model(tempfile.mkdtemp(prefix="kvsidecar-pools-model-"))
    for name in CONFIGS:
        print("RESULT " + json.dumps(run(name, model_dir)), flush=True)
    print(json.dumps({"runs": len(CONFIGS)}), flush=True)  # the last line, for run_json_helper
    return 0


if __name__ == "__main__":
    sys.exit(main())
