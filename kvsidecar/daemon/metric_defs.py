"""Every metric the daemon exports, in one table: name, type, source, meaning, anchor.

The collector renders from these tables and docs/metrics.md is generated from
them (``python -m kvsidecar.daemon.metric_defs > docs/metrics.md``; a test
checks the file is current), so code and documentation cannot drift.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

GAUGE, COUNTER, INFO, HISTOGRAM = "gauge", "counter", "info", "histogram"

RANK_LABELS = ("segment", "engine", "model_name", "role", "dp_rank", "tp_rank", "pp_rank")
POOL_LABELS = (*RANK_LABELS, "pool", "group")
# engine_instance: runtime.instance (schema v1.3), "" from older writers. Not "instance",
# which Prometheus itself sets to the scrape target.
DP_LABELS = ("engine", "model_name", "role", "engine_instance")


@dataclass(frozen=True)
class MetricDef:
    name: str  # full name; counters include _total
    type: str
    unit: str
    help: str
    field: str = ""  # source record field ("" = derived)
    scale: float = 1.0
    anchor: str = ""  # kvcached / ATOM / vLLM / SGLang counterpart
    overlaps: str = ""
    # What docs/metrics.md adds after `help`: the details past what one HELP line carries
    # (every `# HELP name help` line stays within HELP_LINE_MAX characters).
    more: str = ""


HELP_LINE_MAX = 300


RUNTIME: tuple[MetricDef, ...] = (
    MetricDef(
        "kvsidecar_engine_steps_total",
        COUNTER,
        "steps",
        "Engine steps since the agent started (runtime.step).",
        "step",
    ),
    MetricDef(
        "kvsidecar_requests_running",
        GAUGE,
        "requests",
        "Requests scheduled in the last step.",
        "requests_running",
        anchor="vllm:num_requests_running, sglang:num_running_reqs",
    ),
    MetricDef(
        "kvsidecar_requests_waiting",
        GAUGE,
        "requests",
        "Requests queued and not yet scheduled.",
        "requests_waiting",
        anchor="vllm:num_requests_waiting, sglang:num_queue_reqs",
    ),
    MetricDef(
        "kvsidecar_requests_deferred_free",
        GAUGE,
        "requests",
        "Distinct finished or aborted requests still holding KV until every connector "
        "releases them (P/D prefill: decode has not pulled yet), on this rank; a request "
        "deferred in several pools counts once.",
        "requests_deferred_free_distinct",
        anchor="atom:requests_deferred_free (per rank)",
        more="No series when the writer cannot tell (no pool supports deferral; writers "
        "before schema v1.3).",
    ),
    MetricDef(
        "kvsidecar_device_memory_total_bytes",
        GAUGE,
        "bytes",
        "Device memory (GPU: cudaMemGetInfo total; CPU: host MemTotal), sampled <= 10 Hz.",
        "device_total_bytes",
    ),
    MetricDef(
        "kvsidecar_device_memory_free_bytes",
        GAUGE,
        "bytes",
        "Free device memory (GPU: cudaMemGetInfo free; CPU: MemAvailable).",
        "device_free_bytes",
    ),
    MetricDef(
        "kvsidecar_engine_start_time_seconds",
        GAUGE,
        "seconds",
        "Unix time the agent started.",
        "start_time",
    ),
    MetricDef(
        "kvsidecar_agent_publish_errors_total",
        COUNTER,
        "errors",
        "Agent publishes that failed (the engine carried on).",
        "publish_errors_total",
    ),
    MetricDef(
        "kvsidecar_agent_publish_duration_seconds",
        GAUGE,
        "seconds",
        "Duration of the agent's previous publish (self-metric).",
        "last_publish_duration_ns",
        scale=1e-9,
    ),
    MetricDef(
        "kvsidecar_preemptions_total",
        COUNTER,
        "preemptions",
        "Preemptions since the engine started (a request's KV freed to make room, recomputed "
        "when rescheduled), each counted once, as the engine counts them. No series where the "
        "writer has no count (SGLang, kvcached, our pool, writers before schema v1.4).",
        "preemptions_total",
        anchor="vllm:num_preemptions_total, atom:preemptions (per rank)",
    ),
)

ENGINE_INFO = MetricDef(
    "kvsidecar_engine_info",
    INFO,
    "",
    "Static facts of a rank as labels (engine_version, device, dp/tp/pp sizes, schema, "
    "initialized); value 1. No pid label (it would mint a series at every engine restart: "
    "the pid is in /api/v1/snapshots).",
    anchor="kvcached RuntimeSnapshot",
)

_B = "blocks"
POOL: tuple[MetricDef, ...] = (
    MetricDef(
        "kvsidecar_kv_pool_total_blocks",
        GAUGE,
        _B,
        "Current capacity of the pool in blocks (excludes the null block; moves with resize).",
        "total_blocks",
        anchor="vllm num_gpu_blocks - 1; sglang max_total_num_tokens / page_size; "
        "NOT kvcached total_blocks (its initial capacity: see virtual_blocks)",
    ),
    MetricDef(
        "kvsidecar_kv_pool_allocated_blocks",
        GAUGE,
        _B,
        "Blocks held by requests, deferred requests, leases or the reserve ledger.",
        "allocated_blocks",
        anchor="kvcached allocated_blocks",
        overlaps="includes reserved_blocks and deferred_free_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_reserved_blocks",
        GAUGE,
        _B,
        "Blocks in the reserve ledger (try_to_reserve).",
        "reserved_blocks",
        anchor="kvcached reserved_blocks",
        overlaps="counted in allocated_blocks AND in available_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_available_blocks",
        GAUGE,
        _B,
        "Blocks allocatable now: free + evictable cached + reserved.",
        "available_blocks",
        anchor="kvcached available_blocks",
        overlaps="includes reserved_blocks and cached_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_cached_blocks",
        GAUGE,
        _B,
        "Unreferenced prefix-cache blocks kept for reuse, evicted LRU.",
        "cached_blocks",
        anchor="vllm prefix cache (evictable blocks)",
        overlaps="part of available_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_allocated_bytes",
        GAUGE,
        "bytes",
        "allocated_blocks x block_size_bytes x layers x kv_buffers.",
        "allocated_bytes",
        anchor="kvcached allocated_bytes",
        overlaps="includes reserved_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_reserved_bytes",
        GAUGE,
        "bytes",
        "reserved_blocks in bytes (whole pool).",
        "reserved_bytes",
        anchor="kvcached reserved_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_available_bytes",
        GAUGE,
        "bytes",
        "available_blocks in bytes (whole pool).",
        "available_bytes",
        anchor="kvcached available_bytes",
        overlaps="includes reserved_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_virtual_per_layer_bytes",
        GAUGE,
        "bytes",
        "Reserved storage of one layer, all KV buffers: virtual_blocks x block_size_bytes "
        "x kv_buffers (kvcached: the fixed virtual reservation; never below mapped).",
        "virtual_per_layer_bytes",
        anchor="kvcached virtual_per_layer_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_virtual_total_bytes",
        GAUGE,
        "bytes",
        "virtual_per_layer_bytes x layers.",
        "virtual_total_bytes",
        anchor="kvcached virtual_total_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_mapped_bytes",
        GAUGE,
        "bytes",
        "Physically backed bytes of the pool's storage.",
        "mapped_bytes",
        anchor="kvcached mapped_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_layers",
        GAUGE,
        "layers",
        "Layers backed by this pool.",
        "num_layers",
        anchor="kvcached num_layers",
    ),
    MetricDef(
        "kvsidecar_kv_pool_kv_buffers",
        GAUGE,
        "buffers",
        "KV buffers per layer: 2 (K and V) for MHA/GQA, 1 for MLA.",
        "num_kv_buffers",
        anchor="kvcached num_kv_buffers",
    ),
    MetricDef(
        "kvsidecar_kv_pool_block_size_tokens",
        GAUGE,
        "tokens",
        "Tokens per block.",
        "block_size_tokens",
        anchor="vllm block_size",
    ),
    MetricDef(
        "kvsidecar_kv_pool_block_size_bytes",
        GAUGE,
        "bytes",
        "Bytes of one block in one layer and one buffer.",
        "block_size_bytes",
        anchor="kvcached block_size_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_in_shrink",
        GAUGE,
        "",
        "1 while a shrink below the allocated count waits for frees.",
        "in_shrink",
        anchor="kvcached in_shrink",
    ),
    MetricDef(
        "kvsidecar_kv_pool_shrink_target_blocks",
        GAUGE,
        _B,
        "Target of the pending shrink (absent when none).",
        "shrink_target_blocks",
        anchor="kvcached shrink_target_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_requests",
        GAUGE,
        "requests",
        "Deferred (finished, not yet released) requests holding blocks of this pool.",
        "deferred_free_requests",
        anchor="atom:requests_deferred_free",
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_blocks",
        GAUGE,
        _B,
        "Physical blocks held by deferred requests, shared prefix blocks counted once.",
        "deferred_free_blocks",
        anchor="atom:kv_cache_blocks_deferred_free",
        overlaps="subset of allocated_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_tokens_used",
        GAUGE,
        "tokens",
        "Tokens actually stored in the pool's blocks.",
        "tokens_used",
    ),
    MetricDef(
        "kvsidecar_kv_pool_block_allocs_total", COUNTER, _B, "Blocks handed out.", "allocs_total"
    ),
    MetricDef(
        "kvsidecar_kv_pool_block_frees_total",
        COUNTER,
        _B,
        "Blocks whose last reference was dropped.",
        "frees_total",
    ),
    MetricDef(
        "kvsidecar_kv_pool_evictions_total",
        COUNTER,
        _B,
        "Cached prefix blocks evicted to make room.",
        "evictions_total",
    ),
    MetricDef(
        "kvsidecar_kv_pool_alloc_failures_total",
        COUNTER,
        "attempts",
        "Allocation attempts refused for lack of blocks: every failed attempt, so a request "
        "retried each step counts each time (vLLM: allocate_slots calls that returned None; "
        "375 for 8 preemptions in one run). Not a request count: see "
        "kvsidecar_preemptions_total.",
        "alloc_failures_total",
    ),
    MetricDef(
        "kvsidecar_kv_pool_prefix_queries_total",
        COUNTER,
        _B,
        "Full blocks looked up in the prefix cache.",
        "prefix_queries_total",
        anchor="vllm:prefix_cache_queries_total (vLLM counts tokens)",
    ),
    MetricDef(
        "kvsidecar_kv_pool_prefix_hits_total",
        COUNTER,
        _B,
        "Prefix-cache lookups that found the block.",
        "prefix_hits_total",
        anchor="vllm:prefix_cache_hits_total (vLLM counts tokens)",
    ),
    MetricDef(
        "kvsidecar_kv_pool_null_block_reserved",
        GAUGE,
        "",
        "1 if a null block is set aside (kvcached adapter; absent if unsupported).",
        "null_block_reserved",
        anchor="kvcached null_block_reserved",
    ),
    MetricDef(
        "kvsidecar_kv_pool_total_pages",
        GAUGE,
        "pages",
        "kvcached page allocator: total pages (absent if unsupported).",
        "total_pages",
        anchor="kvcached total_pages",
    ),
    MetricDef(
        "kvsidecar_kv_pool_free_pages",
        GAUGE,
        "pages",
        "kvcached: free pages (includes reserved pages).",
        "free_pages",
        anchor="kvcached free_pages",
    ),
    MetricDef(
        "kvsidecar_kv_pool_inuse_pages",
        GAUGE,
        "pages",
        "kvcached: pages in use.",
        "inuse_pages",
        anchor="kvcached inuse_pages",
    ),
    MetricDef(
        "kvsidecar_kv_pool_reserved_pages",
        GAUGE,
        "pages",
        "kvcached: mapped pages held back for reuse.",
        "reserved_pages",
        anchor="kvcached reserved_pages",
    ),
    MetricDef(
        "kvsidecar_kv_pool_resize_target_bytes",
        GAUGE,
        "bytes",
        "kvcached resize target per layer per buffer (absent when none).",
        "resize_target_bytes",
        anchor="kvcached resize_target_bytes (-1 = none)",
    ),
    MetricDef(
        "kvsidecar_kv_pool_prefix_query_tokens_total",
        COUNTER,
        "tokens",
        "Tokens looked up in the prefix cache (vLLM's unit: compare with "
        "vllm:prefix_cache_queries_total directly).",
        "prefix_query_tokens_total",
        anchor="vllm:prefix_cache_queries_total",
        overlaps="the same lookups as prefix_queries_total, in tokens",
    ),
    MetricDef(
        "kvsidecar_kv_pool_prefix_hit_tokens_total",
        COUNTER,
        "tokens",
        "Of the tokens looked up, those found in the prefix cache.",
        "prefix_hit_tokens_total",
        anchor="vllm:prefix_cache_hits_total",
        overlaps="the same hits as prefix_hits_total, in tokens",
    ),
    MetricDef(
        "kvsidecar_kv_pool_page_size_bytes",
        GAUGE,
        "bytes",
        "kvcached: bytes of one physical page, per layer per buffer (KVCACHED_PAGE_SIZE_MB; "
        "absent if unsupported).",
        "page_size_bytes",
        anchor="kvcached page_size_bytes",
    ),
    MetricDef(
        "kvsidecar_kv_pool_available_physical_pages",
        GAUGE,
        "pages",
        "kvcached: pages the device could still map for this pool, per layer per buffer "
        "((cudaMemGetInfo free - reserve for KVCACHED_GPU_UTILIZATION) / page / layers / "
        "buffers).",
        "available_physical_pages",
        anchor="kvcached available_physical_pages",
    ),
    MetricDef(
        "kvsidecar_kv_pool_effective_free_pages",
        GAUGE,
        "pages",
        "kvcached: free pages that can really be backed: min(free_pages, "
        "available_physical_pages + reserved_pages).",
        "effective_free_pages",
        anchor="kvcached effective_free_pages",
    ),
    MetricDef(
        "kvsidecar_kv_pool_virtual_blocks",
        GAUGE,
        _B,
        "Blocks of the reservation behind virtual_per_layer_bytes, null block included "
        "(kvcached: its initial capacity; our pool: storage rows).",
        "virtual_blocks",
        anchor="kvcached total_blocks",
        overlaps="not the current capacity: that is total_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_protected_blocks",
        GAUGE,
        _B,
        "Allocated blocks that are prefix-cache entries pinned by running requests "
        "(SGLang: locked radix-tree nodes; absent if unsupported).",
        "protected_blocks",
        anchor="sglang RadixCache.protected_size() / page_size",
        overlaps="subset of allocated_blocks",
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_ended_total",
        COUNTER,
        "requests",
        "Deferrals of this pool that ended: the connector released the request's blocks "
        "(completed transfer or lease expiry). Absent if unsupported.",
        "deferred_free_ended_total",
        anchor="vllm: requests in KVConnectorOutput.finished_sending",
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_ended_blocks_total",
        COUNTER,
        _B,
        "Blocks the ended deferrals held when they ended, summed per request: a block "
        "several of them shared counts once for each, unlike "
        "kvsidecar_kv_pool_deferred_free_blocks (/ ended_total: blocks per released request).",
        "deferred_free_ended_blocks_total",
        more="E.g. 8 requests sharing 18 distinct blocks, 4 each: +32.",
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_ended_seconds_total",
        COUNTER,
        "seconds",
        "How long the ended deferrals held their KV, summed (/ ended_total: the mean hold).",
        "deferred_free_ended_ns_total",
        scale=1e-9,
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_expired_total",
        COUNTER,
        "requests",
        "Of the ended deferrals, those the connector released at lease expiry, the peer "
        "never having completed its transfer (vLLM NixlConnector; absent for connectors "
        "whose transfer stats report no expiry).",
        "deferred_free_expired_total",
        anchor="vllm:nixl_num_kv_expired_reqs_total",
        overlaps="subset of deferred_free_ended_total",
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_expired_blocks_total",
        COUNTER,
        _B,
        "Blocks the expired deferrals held when their lease ran out, summed per request "
        "like kvsidecar_kv_pool_deferred_free_ended_blocks_total.",
        "deferred_free_expired_blocks_total",
        overlaps="subset of deferred_free_ended_blocks_total",
    ),
    MetricDef(
        "kvsidecar_kv_pool_deferred_free_expired_seconds_total",
        COUNTER,
        "seconds",
        "How long the expired deferrals held their KV, summed (about the lease each). "
        "(ended - expired) / (ended_total - expired_total): the mean hold of completed "
        "transfers.",
        "deferred_free_expired_ns_total",
        scale=1e-9,
        overlaps="subset of deferred_free_ended_seconds_total",
    ),
)

POOL_DERIVED: tuple[MetricDef, ...] = (
    MetricDef(
        "kvsidecar_kv_pool_block_usage_ratio",
        GAUGE,
        "ratio",
        "allocated_blocks / total_blocks (block occupancy; reserved blocks count as used). "
        "Not the gateway's usage (1 - available_blocks / total_blocks) for a pool with "
        "reserved blocks or a pending shrink.",
        anchor="vllm:kv_cache_usage_perc (0-1), where available = total - allocated",
        more="vLLM's kv_cache_usage_perc, and the gateway's usage, are 1 - available_blocks / "
        "total_blocks: the same for vLLM (available = total - allocated), not for a pool "
        "with reserved blocks or a pending shrink (ours, kvcached).",
    ),
    MetricDef(
        "kvsidecar_kv_pool_token_usage_ratio",
        GAUGE,
        "ratio",
        "tokens_used / (total_blocks x block_size_tokens) (token occupancy).",
    ),
    MetricDef(
        "kvsidecar_kv_pool_oldest_deferred_free_age_seconds",
        GAUGE,
        "seconds",
        "How long the oldest deferred request of this pool has held its KV (now - "
        "oldest_deferred_free_mono_ns at scrape time; a writer in another time namespace "
        "through its clock's offset); 0 when none is deferred; none for a future stamp.",
        "oldest_deferred_free_mono_ns",
        anchor="none (no engine exports it)",
        more="A P/D transfer that never completes shows as an age that only grows. A stamp "
        "later than now (a deferral cannot begin in the future: 2^62 read as age 0) is "
        "rejected like a value out of range: no series, counted in "
        '`kvsidecar_source_rejected_values_total{field="pool.oldest_deferred_free_mono_ns"}`.',
    ),
    MetricDef(
        "kvsidecar_kv_pool_block_fill_ratio",
        GAUGE,
        "ratio",
        "tokens_used / (allocated_blocks x block_size_tokens): how full allocated "
        "blocks are; 1 - this is internal fragmentation.",
    ),
)

DP: tuple[MetricDef, ...] = (
    MetricDef(
        "kvsidecar_dp_requests_deferred_free",
        GAUGE,
        "requests",
        "Distinct deferred requests summed over the DP ranks of one engine instance "
        "(tp_rank=0, pp_rank=0 targets: one scheduler per DP rank; label engine_instance). "
        "Up targets only; no series if a rank cannot tell or two claim the same dp_rank.",
        anchor="atom:requests_deferred_free (summed across DP ranks)",
        more="Two engines that look alike are never added.",
    ),
    MetricDef(
        "kvsidecar_dp_kv_blocks_deferred_free",
        GAUGE,
        _B,
        "deferred_free_blocks of every pool summed over the DP ranks of one engine "
        "instance (tp_rank=0, pp_rank=0 targets). Up targets only; no series if a pool "
        "does not support deferral or two up targets claim the same dp_rank.",
        anchor="atom:kv_cache_blocks_deferred_free (summed across DP ranks)",
    ),
)

SOURCE_UP = MetricDef(
    "kvsidecar_source_up",
    GAUGE,
    "",
    "1 if the segment's writer is alive and its snapshot fresh; 0 if stale, dead, "
    "corrupt, refused or not ready (then no per-rank values are exported).",
)
SOURCE_STATE = MetricDef(
    "kvsidecar_source_state",
    GAUGE,
    "",
    "1 for the target's current state (label state: up, stale, dead, corrupt, "
    "not_ready, refused), 0 for the others.",
)
SOURCE_SNAPSHOT_AGE_SECONDS = MetricDef(
    "kvsidecar_source_snapshot_age_seconds",
    GAUGE,
    "seconds",
    "Seconds since the writer last showed progress (a new heartbeat or snapshot), on the "
    "daemon's clock: a writer in another time namespace reads its true age, not its "
    "clock offset; exported in every state.",
    more="A writer's own age is believed at first sight, up to just past --stale-after.",
)
SOURCE_WRITER_RESTARTS_TOTAL = MetricDef(
    "kvsidecar_source_writer_restarts_total",
    COUNTER,
    "restarts",
    "Writer restarts observed (a new incarnation under the same name).",
)
SOURCE_READ_RETRIES_TOTAL = MetricDef(
    "kvsidecar_source_read_retries_total",
    COUNTER,
    "retries",
    "Seqlock read retries (the writer lapped the reader).",
)
SOURCE_DECODE_ERRORS_TOTAL = MetricDef(
    "kvsidecar_source_decode_errors_total",
    COUNTER,
    "errors",
    "Reads rejected as corrupt (bad CRC, layout, payload).",
)
SOURCE_READ_ERRORS_TOTAL = MetricDef(
    "kvsidecar_source_read_errors_total",
    COUNTER,
    "errors",
    "Failed reads by kind (label kind).",
)
SOURCE_PUBLISH_ERRORS_TOTAL = MetricDef(
    "kvsidecar_source_publish_errors_total",
    COUNTER,
    "errors",
    "Publishes the agent counted as failed, read from the segment header (layout "
    "v1.1), so it moves even when no snapshot gets through; the reason is in the "
    "target's error and the engine log.",
    more="Exported once a snapshot was read; before that a failing agent shows as "
    'read_errors_total{kind="publish_failing"}.',
)
SOURCE_GENERATION = MetricDef(
    "kvsidecar_source_generation",
    GAUGE,
    "",
    "Generation of the segment (1 + its dead predecessor's).",
)
SOURCE_LAST_SEQUENCE = MetricDef(
    "kvsidecar_source_last_sequence",
    GAUGE,
    "",
    "Sequence number of the last good snapshot (publishes since start).",
)
SOURCE_BUDGET_REFUSALS_TOTAL = MetricDef(
    "kvsidecar_source_budget_refusals_total",
    COUNTER,
    "reads",
    "Reads refused for the target's budget (label limit: payload_bytes, pools, "
    "label_length, series; flags --max-*) or, with limit total, for --max-exposition-bytes "
    "(this target among the largest); the target is then refused, with health series only.",
    more="Limit total: all targets together exceed --max-exposition-bytes and this one is "
    "among the largest.",
)
SOURCE_REJECTED_VALUES_TOTAL = MetricDef(
    "kvsidecar_source_rejected_values_total",
    COUNTER,
    "values",
    "Values dropped from snapshots (of the wrong type, null in a non-null field, "
    "negative, NaN/Inf or >= 2^63: schema.md, Values), by field (label field, e.g. "
    "pool.allocated_blocks), once per snapshot; the series is omitted as if unsupported.",
)
SOURCE_DUPLICATE_POOLS = MetricDef(
    "kvsidecar_source_duplicate_pools",
    GAUGE,
    "pools",
    "Pools of the last snapshot whose (pool_name, group_id) repeats an earlier pool's; "
    'they are exported as pool="<name>#<n>" (n = 2, 3, ... in payload order), so no '
    "series is ever duplicated.",
)
SOURCE: tuple[MetricDef, ...] = (
    SOURCE_UP,
    SOURCE_STATE,
    SOURCE_SNAPSHOT_AGE_SECONDS,
    SOURCE_WRITER_RESTARTS_TOTAL,
    SOURCE_READ_RETRIES_TOTAL,
    SOURCE_DECODE_ERRORS_TOTAL,
    SOURCE_READ_ERRORS_TOTAL,
    SOURCE_PUBLISH_ERRORS_TOTAL,
    SOURCE_GENERATION,
    SOURCE_LAST_SEQUENCE,
    SOURCE_BUDGET_REFUSALS_TOTAL,
    SOURCE_REJECTED_VALUES_TOTAL,
    SOURCE_DUPLICATE_POOLS,
)

REFUSED_SEGMENTS = MetricDef(
    "kvsidecar_refused_segments",
    GAUGE,
    "",
    "Files in the shm directory matching the prefix that the daemon does not follow now "
    "(symlink, FIFO, foreign owner, unreadable, newer major version, over --max-targets); "
    "the log summarizes why.",
    more="Exact as of the last listing, those beyond the remembered 16,384 included "
    "(kvsidecar_refused_segments_unremembered).",
)
SEGMENT_REFUSALS_TOTAL = MetricDef(
    "kvsidecar_segment_refusals_total",
    COUNTER,
    "files",
    "Discovered files refused, once per file identity, by reason (symlink, not_regular, "
    "foreign_owner, version, unreadable, vanished, max_targets, admission); names in the "
    "log, never a label. A lower bound while kvsidecar_refused_segments_unremembered > 0.",
    more="Reasons: version = a newer major version, vanished = gone before it could be "
    "read, max_targets = over --max-targets, admission = a new name that had to wait for "
    "--max-new-targets (counted once per target). The files still refused are counted by "
    "reason in kvsidecar_refused_segments_by_reason; their names are in the log, `kvsidecar "
    "ls` and /api/v1/snapshots, never in a label (whoever can create a file would choose "
    "it). Files beyond the remembered ones are not counted.",
)
DISCOVERY_UP = MetricDef(
    "kvsidecar_discovery_up",
    GAUGE,
    "",
    "1 if the last scan of the shm directory succeeded; 0 while it fails (known targets "
    "are still served; /-/ready and the log say why).",
)
DISCOVERY_ERRORS_TOTAL = MetricDef(
    "kvsidecar_discovery_errors_total",
    COUNTER,
    "errors",
    "Failed scans of the shm directory, and segments that could not be opened for lack "
    "of descriptors or memory, by errno name (label cause, e.g. EACCES, EMFILE).",
)
SOURCES = MetricDef("kvsidecar_sources", GAUGE, "", "Segments currently followed.")
BUILD_INFO = MetricDef(
    "kvsidecar_build_info",
    INFO,
    "",
    "kvsidecar version and source revision (labels version, revision: a git commit, or "
    "unknown); value 1.",
)
POLL_DURATION_SECONDS = MetricDef(
    "kvsidecar_poll_duration_seconds",
    GAUGE,
    "seconds",
    "Duration of the last poll of every segment.",
)
POLLS_TOTAL = MetricDef("kvsidecar_polls_total", COUNTER, "polls", "Poll cycles run.")
HTTP_REQUESTS_TOTAL = MetricDef(
    "kvsidecar_http_requests_total",
    COUNTER,
    "requests",
    "HTTP requests served (labels handler, code).",
)
HTTP_REQUEST_DURATION_SECONDS = MetricDef(
    "kvsidecar_http_request_duration_seconds",
    HISTOGRAM,
    "seconds",
    "HTTP request duration (label handler).",
)
GATEWAY_REQUESTS_TOTAL = MetricDef(
    "kvsidecar_gateway_requests_total",
    COUNTER,
    "requests",
    "Polls answered on the gateway listeners (--gateway.listen-address), by status code "
    "(label code): 200 with a rank's fresh numbers, 503 for a rank that is not up. No "
    "series while the gateway is off.",
)
GATEWAY_ANSWERS_TOTAL = MetricDef(
    "kvsidecar_gateway_answers_total",
    COUNTER,
    "answers",
    "Gateway polls by rank (dp_rank: the listener, fixed by --gateway.ranks), outcome (ok "
    "200; no_segment, ambiguous, not_fresh, not_up 503; not_found 404) and role (the "
    "listener's --gateway.role, any without one).",
    more="A fixed set of outcomes, never a value a client or a writer chooses. A change of "
    "a rank's outcome is logged once (a 503 streak at its start, with its reason, and its "
    "end), and `/-/ready` names the ranks whose last poll got a 503.",
)
GATEWAY_CONNECTIONS = MetricDef(
    "kvsidecar_gateway_connections",
    GAUGE,
    "connections",
    "Open connections on the gateway listeners (at most --gateway.max-connections).",
)
GATEWAY_CONNECTIONS_CLOSED_TOTAL = MetricDef(
    "kvsidecar_gateway_connections_closed_total",
    COUNTER,
    "connections",
    "Gateway connections the daemon closed (label reason: evicted = made room for a "
    "newcomer at the cap, refused = the cap was full of responses in flight, slow_head, "
    "slow_reader, idle, error).",
)
REFUSED_SEGMENTS_BY_REASON = MetricDef(
    "kvsidecar_refused_segments_by_reason",
    GAUGE,
    "files",
    "Files the daemon found and does not follow now, among those remembered, by reason "
    "(label reason: version, unreadable, symlink, not_regular, foreign_owner, "
    "max_targets, ...). Which files: the log, `kvsidecar ls`, /api/v1/snapshots (refused).",
    more="Reason version: a newer major layout/schema version. Replaces "
    "kvsidecar_refused_file{file}, whose label value any user who could create a file "
    "chose (3,072-3,840 values in 15 s).",
)
TARGETS_WAITING = MetricDef(
    "kvsidecar_targets_waiting",
    GAUGE,
    "",
    "Segments followed but not exported yet: new names waiting for admission "
    "(--max-new-targets, then one per --new-target-interval; live and longest-followed "
    "first). No series carries their names until they are admitted.",
)
REFUSED_SEGMENTS_UNREMEMBERED = MetricDef(
    "kvsidecar_refused_segments_unremembered",
    GAUGE,
    "",
    "Refused files of the last listing beyond the 16,384 the daemon remembers: each is "
    "refused again from an lstat at every listing, never followed, and not counted in "
    "kvsidecar_segment_refusals_total.",
    more="The daemon's memory stays bounded however many files others create.",
)
OTLP_DROPPED_BATCHES_TOTAL = MetricDef(
    "kvsidecar_otlp_dropped_batches_total",
    COUNTER,
    "batches",
    "OTLP push batches lost (--otlp.endpoint), by reason: queue_full = the oldest unsent "
    "batch dropped from the bounded queue, send_failed = the exporter gave up after its "
    "retries (the log names why). No series while the push is off.",
    more="docs/otlp.md. queue_full: the collector was slow or unreachable; send_failed: "
    "refused, timed out, TLS or HTTP error.",
)
OTLP_EXPORTED_BATCHES_TOTAL = MetricDef(
    "kvsidecar_otlp_exported_batches_total",
    COUNTER,
    "batches",
    "OTLP push batches the collector accepted (--otlp.endpoint). Flat while the push is on: "
    "every push fails or the push stopped (alert KvsidecarOtlpPushFailing). No series while "
    "the push is off.",
)
LOAD_PUSH_MESSAGES_TOTAL = MetricDef(
    "kvsidecar_load_push_messages_total",
    COUNTER,
    "messages",
    "LoadStat messages the load push sent (--load-push.endpoint), by rank (dp_rank: its "
    "socket, port + dp_rank) and reason: changed = a step changed the values, resent = the "
    "last one again after a second. No series while the push is off.",
    more="docs/load-push.md. A rank that stops counting is not up, not fresh, or claimed "
    "by two segments: the log says which, once.",
)
DAEMON: tuple[MetricDef, ...] = (
    REFUSED_SEGMENTS,
    SEGMENT_REFUSALS_TOTAL,
    DISCOVERY_UP,
    DISCOVERY_ERRORS_TOTAL,
    SOURCES,
    BUILD_INFO,
    POLL_DURATION_SECONDS,
    POLLS_TOTAL,
    HTTP_REQUESTS_TOTAL,
    HTTP_REQUEST_DURATION_SECONDS,
    GATEWAY_REQUESTS_TOTAL,
    GATEWAY_ANSWERS_TOTAL,
    GATEWAY_CONNECTIONS,
    GATEWAY_CONNECTIONS_CLOSED_TOTAL,
    REFUSED_SEGMENTS_BY_REASON,
    TARGETS_WAITING,
    REFUSED_SEGMENTS_UNREMEMBERED,
    OTLP_DROPPED_BATCHES_TOTAL,
    OTLP_EXPORTED_BATCHES_TOTAL,
    LOAD_PUSH_MESSAGES_TOTAL,
)

ALL: tuple[MetricDef, ...] = (*RUNTIME, ENGINE_INFO, *POOL, *POOL_DERIVED, *DP, *SOURCE, *DAEMON)


def exported_names() -> list[str]:
    """Every sample name that can appear in a scrape (histograms expanded, info with _info)."""
    names = []
    for m in ALL:
        if m.type == HISTOGRAM:
            names += [f"{m.name}_bucket", f"{m.name}_sum", f"{m.name}_count"]
        else:
            names.append(m.name)
    return names


def markdown() -> str:
    out = [
        "# Metrics",
        "",
        "Generated from `kvsidecar/daemon/metric_defs.py` "
        "(`python -m kvsidecar.daemon.metric_defs > docs/metrics.md`).",
        "",
        "Labels. Per-rank metrics carry `" + "`, `".join(RANK_LABELS) + "` (`model_name` and "
        "`engine` as vLLM names them); pool metrics add `pool` (pool_name) and `group` "
        "(group_id). DP sums carry `" + "`, `".join(DP_LABELS) + "` (the "
        "agent's `KVSIDECAR_INSTANCE`, default the host name: the Pod's under Kubernetes, the "
        "same across engine restarts). Source-health metrics "
        "carry `segment` plus the rank labels last seen.",
        "",
        "Freshness. A target that is stale, dead, corrupt or not ready exports only its "
        "source-health metrics (`kvsidecar_source_up 0` and its age), never its old values as "
        "if fresh. Optional fields the writer does not support (null) produce no series.",
        "",
        "Overlaps. Never sum block gauges: allocated includes reserved; available includes "
        "reserved and cached; deferred-free blocks are part of allocated.",
        "",
        "| name | type | unit | meaning | source field | anchor | overlaps |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in ALL:
        field = m.field + (f" x {m.scale:g}" if m.scale != 1.0 else "")
        meaning = f"{m.help} {m.more}" if m.more else m.help
        out.append(
            f"| `{m.name}` | {m.type} | {m.unit} | {meaning} | {field} | {m.anchor} "
            f"| {m.overlaps} |"
        )
    return "\n".join(out) + "\n" + _gateway_markdown()


# A gateway family an engine's record never fills (SGLang keeps no deferral: null).
_NOT_SERVED = "not served (null in SGLang's record)"


def _gateway_markdown() -> str:
    """The gateway endpoint's families (docs/gateway.md): not on /metrics, never scraped."""
    from kvsidecar.daemon import gateway_body as gb

    out = [
        "",
        "## Gateway endpoint (`--gateway.listen-address`)",
        "",
        "Served per DP rank on the gateway listeners only, for an endpoint picker, never for "
        "Prometheus (the engine serves the same names: scraping both would double every sum "
        "over them; docs/gateway.md). All gauges, no HELP lines, read fresh at each poll. "
        "An engine without names of its own (our demo, kvcached) gets vLLM's.",
        "",
        "| meaning | unit | vLLM | SGLang | ATOM |",
        "|---|---|---|---|---|",
    ]
    e = (gb.VLLM, gb.SGLANG, gb.ATOM)
    rows = [
        ("queued requests (requests_waiting)", "requests", [n.waiting for n in e]),
        ("running requests (requests_running)", "requests", [n.running for n in e]),
        (
            "KV-cache usage. vLLM's names (also our pool, kvcached): 1 - available_blocks / "
            "total_blocks summed over the pools, vLLM's `BlockPool.get_usage()` (free, "
            "evictable and reserved blocks count as free; during a pending shrink only the "
            "room below its target does); SGLang: the fullest pool's allocated / total, "
            "rounded to 2 decimals, as SGLang does; ATOM: allocated / total",
            "ratio 0-1",
            [n.usage for n in e],
        ),
        (
            "block size and count, in the labels; value 1. The count is the capacity the "
            "usage divides by: vLLM's num_gpu_blocks is total_blocks + 1 (its null block), "
            "so usage = 1 - available / (num_gpu_blocks - 1); never the storage "
            "(virtual_blocks), which a shrink keeps",
            "",
            [f"{n.cache_info}{{{n.block_size_label},{n.num_blocks_label}}}" for n in e],
        ),
        (
            "KV blocks held for P/D transfer (deferred frees; distinct blocks summed over "
            "pools; inside the usage)",
            "blocks",
            [gb.HELD_BLOCKS, _NOT_SERVED, gb.HELD_BLOCKS],
        ),
        (
            "age of the oldest deferral still holding KV (0 when none; absent when the "
            "writer's stamp is later than now)",
            "seconds",
            [gb.HELD_AGE, _NOT_SERVED, gb.HELD_AGE],
        ),
    ]
    for meaning, unit, names in rows:
        cells = [n if n == _NOT_SERVED else f"`{n}`" for n in names]
        out.append(f"| {meaning} | {unit} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(
        "Labels: vLLM's `engine` (the DP rank) and `model_name`; SGLang's `model_name`, "
        "`engine_type` (prefill, decode, unified), `tp_rank`, `pp_rank`, `moe_ep_rank` "
        "(always 0: not in the segment) and `dp_rank` when dp_size > 1; ATOM's none. "
        "`cache_config_info` carries vLLM's `engine` and the two sizes (SGLang, ATOM: the "
        "sizes alone); the two kvsidecar families carry no labels."
    )
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(markdown())
