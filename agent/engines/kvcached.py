"""kvcached: a `PoolSource` over kvcached's plain-dict observability snapshot.

kvcached (PR #385, schema ``kvcached.observability.v1``) exposes
``KVCacheManager.observability_snapshot_dict()`` / ``kv_cache_pool_snapshot_dicts()``;
this module maps those dicts onto our record without importing kvcached.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvsidecar.protocol.schema import KVCachePoolSnapshot

# kvcached int fields with the same name and meaning as ours (whole-pool bytes, blocks).
_INT_FIELDS = (
    "group_id",
    "num_layers",
    "num_kv_buffers",
    "block_size_bytes",
    "total_blocks",
    "allocated_blocks",
    "reserved_blocks",
    "available_blocks",
    "allocated_bytes",
    "reserved_bytes",
    "available_bytes",
    "virtual_per_layer_bytes",
    "virtual_total_bytes",
    "mapped_bytes",
)
_OPTIONAL_INT_FIELDS = ("total_pages", "free_pages", "inuse_pages", "reserved_pages")


def _int(value: Any, default: int = 0) -> int:
    # kvcached clamps counts at 0 (#436 saw -127 from unlocked reads); do the same.
    if value is None or isinstance(value, bool):
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        return default
    return n if n > 0 else 0


def _opt_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n > 0 else 0


def from_kvcached_dict(d: Mapping[str, Any], pool_name: str = "block_pool") -> KVCachePoolSnapshot:
    """Convert one kvcached pool snapshot dict; unknown keys ignored, missing ones default.

    * ``pool_name`` None/missing -> the given default.
    * ``num_kv_buffers`` missing -> 2.
    * ``resize_target_bytes``: kvcached uses -1 for "no target"; any negative -> None.
    * ``shrink_target_blocks`` passes through (None when missing).
    * Fields kvcached does not have (cached/deferred/tokens/op counters) stay ``None``,
      the schema's "unsupported", so no exporter shows a fake 0; ``block_size_tokens``
      stays 0 (unknown). ``total_blocks`` is kvcached's initial capacity (its ``resize()``
      does not update it).
    """
    snap = KVCachePoolSnapshot(pool_name=d.get("pool_name") or pool_name)
    for name in _INT_FIELDS:
        if name in d:
            setattr(snap, name, _int(d[name]))
    if d.get("num_kv_buffers") is None:
        snap.num_kv_buffers = 2
    pool_type = d.get("pool_type")
    if isinstance(pool_type, str) and pool_type:
        snap.pool_type = pool_type
    snap.in_shrink = bool(d.get("in_shrink", False))
    snap.shrink_target_blocks = _opt_int(d.get("shrink_target_blocks"))
    integration = d.get("integration")
    snap.integration = integration if isinstance(integration, str) else None
    nbr = d.get("null_block_reserved")
    snap.null_block_reserved = bool(nbr) if nbr is not None else None
    for name in _OPTIONAL_INT_FIELDS:
        setattr(snap, name, _opt_int(d.get(name)))
    target = d.get("resize_target_bytes")
    if target is None or isinstance(target, bool):
        snap.resize_target_bytes = None
    else:
        try:
            t = int(target)
        except (TypeError, ValueError):
            t = -1
        snap.resize_target_bytes = t if t >= 0 else None
    return snap


class KvcachedDictAdapter:
    """`PoolSource` over a callable returning kvcached's ``observability_snapshot_dict()``."""

    def __init__(
        self, source: Callable[[], Mapping[str, Any]], *, pool_name: str = "block_pool"
    ) -> None:
        self._source = source
        self._pool_name = pool_name

    def snapshot(self) -> KVCachePoolSnapshot:
        return from_kvcached_dict(self._source(), self._pool_name)
