"""The model-server protocol body for one engine rank, in the engine's own names.

A gateway's endpoint picker (Gateway API Inference Extension, llm-d-router) reads three
gauges per endpoint (queued requests, running requests, KV-cache usage 0-1) and the block
size and count from the labels of a ``cache_config_info`` gauge, with its built-in names
per engine (`vllm:*`, `sglang:*`). Serving those names lets an unchanged picker config read
the sidecar instead of the engine. Each value means what the engine's own series means:

* vLLM: ``vllm:kv_cache_usage_perc`` is ``BlockPool.get_usage()``, 1 - free /
  (num_gpu_blocks - 1), with free = available_blocks (free + evictable cached) and
  num_gpu_blocks - 1 = total_blocks; ``num_gpu_blocks`` counts the null block. The same
  formula for every source served in vLLM's names (our pool, kvcached): 1 - available /
  total, the current capacity (not the storage, virtual_blocks, which a shrink keeps), so
  reserved blocks count as free and a pending shrink's excess as used (docs/gateway.md);
* SGLang: ``sglang:token_usage`` is the largest pool's num_used / capacity, rounded to two
  decimals as SGLang rounds it; ``sglang:cache_config_info{page_size,num_pages}``, which
  SGLang itself does not emit (it has ``sglang:page_size`` / ``sglang:num_pages``);
* ATOM: ``atom:kv_cache_usage_ratio`` is used / total blocks; ``atom:cache_config_info``
  as ATOM #1873 proposes.

Beyond the protocol, the P/D held KV under kvsidecar's names (deferred-free blocks and the
oldest deferral's age), for a picker's ``customMetrics``. Text format 0.0.4 as Prometheus
``expfmt`` parses it: one TYPE per family before its samples, legacy names, every family a
gauge, no HELP lines (optional; they would double the body). An engine we have no names
for (our demo, kvcached) gets vLLM's, the picker's default engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot

__all__ = [
    "CONTENT_TYPE",
    "HELD_AGE",
    "HELD_BLOCKS",
    "NAMES",
    "USAGE_FREE",
    "USAGE_FULLEST",
    "USAGE_USED",
    "EngineNames",
    "engine_names",
    "render",
    "timeless",
    "usage_kind",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

HELD_BLOCKS = "kvsidecar_rank_kv_blocks_deferred_free"
HELD_AGE = "kvsidecar_rank_oldest_deferred_free_age_seconds"

Labels = Callable[[RuntimeSnapshot], list[tuple[str, str]]]


@dataclass(frozen=True)
class EngineNames:
    """One engine's series names and labels for the protocol's families."""

    waiting: str
    running: str
    usage: str
    cache_info: str
    block_size_label: str
    num_blocks_label: str
    labels: Labels
    # The info gauge's labels besides the two sizes (vLLM: engine, not model_name).
    info_labels: Labels
    usage_digits: int | None = None  # SGLang rounds token_usage to 2 decimals


def _vllm_labels(rt: RuntimeSnapshot) -> list[tuple[str, str]]:
    # vLLM's per-engine labels, in its order: engine is the DP engine index.
    return [("engine", str(rt.dp_rank)), ("model_name", rt.model_name)]


_SGLANG_ENGINE_TYPE = {"prefill": "prefill", "decode": "decode"}


def _sglang_labels(rt: RuntimeSnapshot) -> list[tuple[str, str]]:
    # SchedulerMetricsCollector's labels; moe_ep_rank is not in the segment (0, as for
    # every non-MoE-EP server); dp_rank only where SGLang adds it (a DP server).
    labels = [
        ("model_name", rt.model_name),
        ("engine_type", _SGLANG_ENGINE_TYPE.get(rt.role, "unified")),
        ("tp_rank", str(rt.tp_rank)),
        ("pp_rank", str(rt.pp_rank)),
        ("moe_ep_rank", "0"),
    ]
    if rt.dp_size is not None and rt.dp_size > 1:
        labels.append(("dp_rank", str(rt.dp_rank)))
    return labels


def _no_labels(rt: RuntimeSnapshot) -> list[tuple[str, str]]:
    return []  # ATOM's own gauges carry none (it sums its DP ranks)


VLLM = EngineNames(
    waiting="vllm:num_requests_waiting",
    running="vllm:num_requests_running",
    usage="vllm:kv_cache_usage_perc",
    cache_info="vllm:cache_config_info",
    block_size_label="block_size",
    num_blocks_label="num_gpu_blocks",
    labels=_vllm_labels,
    info_labels=lambda rt: [("engine", str(rt.dp_rank))],
)
SGLANG = EngineNames(
    waiting="sglang:num_queue_reqs",
    running="sglang:num_running_reqs",
    usage="sglang:token_usage",
    cache_info="sglang:cache_config_info",
    block_size_label="page_size",
    num_blocks_label="num_pages",
    labels=_sglang_labels,
    info_labels=_no_labels,  # SGLang emits no such family: the sizes alone
    usage_digits=2,
)
ATOM = EngineNames(
    waiting="atom:requests_waiting",
    running="atom:requests_running",
    usage="atom:kv_cache_usage_ratio",
    cache_info="atom:cache_config_info",
    block_size_label="block_size",
    num_blocks_label="num_gpu_blocks",
    labels=_no_labels,
    info_labels=_no_labels,
)
NAMES = {"vllm": VLLM, "sglang": SGLANG, "atom": ATOM}


def engine_names(engine: str) -> EngineNames:
    """The names for a runtime's `engine` field; vLLM's (the picker's default) otherwise."""
    return NAMES.get(engine, VLLM)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels_text(labels: list[tuple[str, str]]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _number(v: float) -> str:
    return repr(float(v)) if math.isfinite(v) else "NaN"


def _family(lines: list[str], name: str, labels: str, value: float) -> None:
    # No HELP line (optional in the format; the picker reads none): the body stays under
    # 1 KB with a long model name. docs/gateway.md says what each family means.
    lines.append(f"# TYPE {name} gauge")
    lines.append(f"{name}{labels} {_number(value)}")


def _sized(pools: list[KVCachePoolSnapshot]) -> list[KVCachePoolSnapshot]:
    """The pools with a capacity and a known allocation: the usage's and the count's."""
    return [p for p in pools if p.total_blocks and p.allocated_blocks is not None]


# How a usage is computed (`usage_kind`): 1 - free / total, used / total, or the fullest
# pool's used / capacity.
USAGE_FREE, USAGE_USED, USAGE_FULLEST = "free", "used", "fullest"


def usage_kind(sized: list[KVCachePoolSnapshot], names: EngineNames) -> str | None:
    """Which formula `_usage` applies to these pools (None: no usage)."""
    if not sized:
        return None
    if names.usage_digits is not None:
        return USAGE_FULLEST
    if names is not ATOM and all(p.available_blocks is not None for p in sized):
        return USAGE_FREE
    return USAGE_USED


def _usage(sized: list[KVCachePoolSnapshot], names: EngineNames) -> float | None:
    """KV-cache usage computed as the engine computes it, to the last bit: vLLM's
    ``BlockPool.get_usage()`` is 1 - free / (num_gpu_blocks - 1), its free queue being our
    available_blocks (summed over the pools; num_gpu_blocks - 1 is their total_blocks);
    SGLang's the fullest pool's used / capacity, rounded to 2 decimals; ATOM's used / total
    blocks."""
    kind = usage_kind(sized, names)
    if kind is None:
        return None
    if kind == USAGE_FULLEST:
        usage = max(p.allocated_blocks / p.total_blocks for p in sized)
        return round(_in_range(usage), names.usage_digits)  # type: ignore[arg-type]
    total = sum(p.total_blocks for p in sized)
    if kind == USAGE_FREE:
        return _in_range(1.0 - sum(p.available_blocks for p in sized) / total)
    return _in_range(sum(p.allocated_blocks for p in sized) / total)


def _in_range(usage: float) -> float:
    """The protocol's range, [0, 1], whatever the fields say. Fields that disagree (more
    blocks available or allocated than the capacity, each in range on its own) are served
    as full, 1.0: a picker routing on the lowest usage must never favour a rank for
    numbers that cannot be true (available > total was served as -999.0)."""
    return usage if 0.0 <= usage <= 1.0 else 1.0


def _num_blocks(sized: list[KVCachePoolSnapshot], names: EngineNames) -> int:
    """The block count label: the current capacity the usage divides by, never the storage
    (virtual_blocks: a resized pool keeps rows it no longer offers). vLLM's num_gpu_blocks
    also counts its null block, so usage = 1 - free / (num_gpu_blocks - 1) exactly."""
    if names is SGLANG:
        return sized[0].total_blocks  # num_pages: usable pages (SGLang has one pool)
    null = 1 if sized[0].null_block_reserved else 0
    return sum(p.total_blocks for p in sized) + null


def _held(pools: list[KVCachePoolSnapshot], now_mono_ns: int) -> tuple[int | None, float | None]:
    blocks = [p.deferred_free_blocks for p in pools if p.deferred_free_blocks is not None]
    since = [p.oldest_deferred_free_mono_ns for p in pools]
    known = [s for s in since if s is not None]
    age: float | None = None
    if known:
        started = [s for s in known if s > 0]
        # Same clock as the writer (CLOCK_MONOTONIC is per boot, shared by every process).
        age = max(0, now_mono_ns - min(started)) / 1e9 if started else 0.0
    return (sum(blocks) if blocks else None), age


def timeless(snapshot: Snapshot) -> bool:
    """The body depends on the snapshot alone (no deferral whose age grows): cacheable."""
    return all(not p.oldest_deferred_free_mono_ns for p in snapshot.pools)


def render(snapshot: Snapshot, now_mono_ns: int) -> bytes:
    """The body for one rank: the protocol's families and the held KV, ~0.5-1 KB."""
    rt = snapshot.runtime
    names = engine_names(rt.engine)
    labels = _labels_text(names.labels(rt))
    lines: list[str] = []
    if rt.requests_waiting is not None:
        _family(lines, names.waiting, labels, rt.requests_waiting)
    if rt.requests_running is not None:
        _family(lines, names.running, labels, rt.requests_running)
    pools = snapshot.pools
    sized = _sized(pools)
    usage = _usage(sized, names)
    if usage is not None:
        _family(lines, names.usage, labels, usage)
    if sized and sized[0].block_size_tokens:
        info = [
            *names.info_labels(rt),
            (names.block_size_label, str(sized[0].block_size_tokens)),
            (names.num_blocks_label, str(_num_blocks(sized, names))),
        ]
        _family(lines, names.cache_info, _labels_text(sorted(info)), 1.0)
    blocks, age = _held(pools, now_mono_ns)
    if blocks is not None:
        _family(lines, HELD_BLOCKS, "", blocks)  # ours: no engine labels (one rank here)
    if age is not None:
        _family(lines, HELD_AGE, "", age)
    lines.append("")
    return "\n".join(lines).encode()
