"""kvcached: a `PoolSource` over kvcached's observability snapshot, and its page fields.

kvcached (PR #385, schema ``kvcached.observability.v1``, ``kvcached/observability.py``)
exposes ``KVCacheManager.observability_snapshot_dict()``, the registry's
``get_registered_kv_cache_pool_snapshot_dicts()`` and ``get_capabilities()``. This module maps
those plain dicts onto our record without importing kvcached (only `page_fields` does, and
only when handed a manager rather than a dict).

Field by field (kvcached name -> ours), checked against kvcached 0.1.6's own
``build_kv_cache_pool_snapshot`` by tests/engines/test_kvcached_real.py:

* Same name, same value: pool_name, pool_type, integration, group_id, num_layers,
  num_kv_buffers, page_size_bytes, block_size_bytes, reserved_blocks, available_blocks,
  reserved_bytes, available_bytes, null_block_reserved, virtual_per_layer_bytes,
  virtual_total_bytes, mapped_bytes, total_pages, free_pages, inuse_pages, reserved_pages,
  available_physical_pages, effective_free_pages, in_shrink.
* Renamed: kvcached ``total_blocks`` (its *initial* ``num_blocks``, null block included;
  ``resize()`` does not change it) -> ``virtual_blocks``.
* Deliberately different, so that one field name means one thing for every source:

  - ``total_blocks`` is the *current* usable capacity: ``min(num_blocks, total_pages x
    (page_size_bytes // block_size_bytes))`` (``PageAllocator.resize`` changes
    ``total_pages``), minus the null block. An upper bound when a block does not divide a
    page (blocks that straddle pages belong to neither), as kvcached's own
    ``available_size()`` is.
  - ``allocated_blocks``/``allocated_bytes`` and ``shrink_target_blocks`` exclude the null
    block (kvcached takes it through ``alloc(1)`` and counts it), as for every other source.
  - ``resize_target_bytes``: kvcached's -1 ("no target") becomes null.
  - Negative counts (#436 saw -127 from unlocked reads) are clamped at 0, as kvcached does.

* Not in kvcached's record: ``cached_blocks``, deferral, ``tokens_used``,
  ``protected_blocks`` stay null ("unsupported"); ``block_size_tokens`` is 0 unless the
  caller knows it. The operation counters (``allocs_total`` ...) stay null unless
  kvcached's capability record says ``features.operation_counters`` is true (0.1.6 says
  false: #410 has not landed), and then only those it names in ``operation_counter_names``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvsidecar.protocol.schema import KVCachePoolSnapshot

# kvcached int fields with the same name and meaning as ours.
_INT_FIELDS = (
    "group_id",
    "num_layers",
    "num_kv_buffers",
    "block_size_bytes",
    "reserved_blocks",
    "available_blocks",
    "reserved_bytes",
    "available_bytes",
    "virtual_per_layer_bytes",
    "virtual_total_bytes",
    "mapped_bytes",
)
_OPTIONAL_INT_FIELDS = (
    "total_pages",
    "free_pages",
    "inuse_pages",
    "reserved_pages",
    "page_size_bytes",
    "available_physical_pages",
    "effective_free_pages",
)
# Our counters that a kvcached with operation counters could fill (same names required).
_COUNTER_FIELDS = ("allocs_total", "frees_total", "evictions_total", "alloc_failures_total")

# What a plugin that publishes a kvcached-backed pool itself (vLLM's BlockPool over
# kvcached's ElasticBlockPool) takes from kvcached: the physical side vLLM cannot see.
PAGE_FIELDS = (
    "page_size_bytes",
    "total_pages",
    "free_pages",
    "inuse_pages",
    "reserved_pages",
    "available_physical_pages",
    "effective_free_pages",
    "mapped_bytes",
    "virtual_blocks",
    "virtual_per_layer_bytes",
    "virtual_total_bytes",
    "resize_target_bytes",
)


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


def operation_counters_supported(capabilities: Mapping[str, Any] | None) -> bool:
    """kvcached's ``get_capabilities()["features"]["operation_counters"]`` (missing = no)."""
    if not capabilities:
        return False
    features = capabilities.get("features")
    return isinstance(features, Mapping) and features.get("operation_counters") is True


def from_kvcached_dict(
    d: Mapping[str, Any],
    pool_name: str = "block_pool",
    *,
    capabilities: Mapping[str, Any] | None = None,
    block_size_tokens: int = 0,
) -> KVCachePoolSnapshot:
    """Convert one kvcached pool snapshot dict (see the module doc for each field).

    Unknown keys are ignored, missing ones default: ``pool_name`` None/missing -> the
    given default; ``num_kv_buffers`` missing -> 2. ``capabilities`` is kvcached's
    ``get_capabilities()`` record; ``block_size_tokens`` what the engine knows.
    """
    snap = KVCachePoolSnapshot(pool_name=d.get("pool_name") or pool_name)
    for name in _INT_FIELDS:
        if name in d:
            setattr(snap, name, _int(d[name]))
    if d.get("num_kv_buffers") is None:
        snap.num_kv_buffers = 2
    snap.block_size_tokens = _int(block_size_tokens)
    pool_type = d.get("pool_type")
    if isinstance(pool_type, str) and pool_type:
        snap.pool_type = pool_type
    snap.in_shrink = bool(d.get("in_shrink", False))
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

    # kvcached counts its null block as allocated and in num_blocks; we never do.
    null = 1 if nbr else 0
    initial = _opt_int(d.get("total_blocks"))
    snap.virtual_blocks = initial
    capacity = initial or 0
    pages, page, block = snap.total_pages, snap.page_size_bytes, snap.block_size_bytes
    if pages is not None and page and block and page >= block:
        by_pages = pages * (page // block)
        if by_pages < capacity or initial is None:
            capacity = by_pages
    snap.total_blocks = max(capacity - null, 0)
    allocated = _int(d.get("allocated_blocks"))
    snap.allocated_blocks = max(allocated - null, 0) if allocated else 0
    unit = snap.block_size_bytes * snap.num_layers * snap.num_kv_buffers
    snap.allocated_bytes = snap.allocated_blocks * unit if unit else _int(d.get("allocated_bytes"))
    target_blocks = _opt_int(d.get("shrink_target_blocks"))
    snap.shrink_target_blocks = None if target_blocks is None else max(target_blocks - null, 0)

    if operation_counters_supported(capabilities):
        named = set((capabilities or {}).get("operation_counter_names") or ())
        for name in _COUNTER_FIELDS:
            if name in named and name in d:
                setattr(snap, name, _opt_int(d[name]))
    return snap


class KvcachedDictAdapter:
    """`PoolSource` over a callable returning kvcached's ``observability_snapshot_dict()``.

    Pass kvcached's ``get_capabilities()`` record so that counters kvcached does not keep
    stay null. kvcached's snapshot is not O(1) (``_get_num_alloced_blocks`` walks its
    pages, ``available_size()`` may query the driver): use it where kvcached is the pool.
    """

    def __init__(
        self,
        source: Callable[[], Mapping[str, Any]],
        *,
        pool_name: str = "block_pool",
        capabilities: Mapping[str, Any] | None = None,
        block_size_tokens: int = 0,
    ) -> None:
        self._source = source
        self._pool_name = pool_name
        self._capabilities = capabilities
        self._block_size_tokens = block_size_tokens

    def snapshot(self) -> KVCachePoolSnapshot:
        return from_kvcached_dict(
            self._source(),
            self._pool_name,
            capabilities=self._capabilities,
            block_size_tokens=self._block_size_tokens,
        )


def kvcached_pool_dict(manager: Any, *, integration: str | None = None) -> dict[str, Any]:
    """kvcached's snapshot dict of one pool: through the manager's own locked entry point
    (``observability_snapshot``, one lock hold) when it has one, else kvcached's
    ``build_kv_cache_pool_snapshot`` (the duck-typed path kvcached documents). Imports
    kvcached only in the second case."""
    take = getattr(manager, "observability_snapshot", None)
    if take is not None:
        return take(integration=integration).to_dict()
    from kvcached.observability import build_kv_cache_pool_snapshot

    return build_kv_cache_pool_snapshot(manager, integration=integration).to_dict()


def page_fields(manager_or_dict: Any, *, integration: str | None = None) -> dict[str, Any]:
    """kvcached's physical/page fields of one pool, keyed by our field names (`PAGE_FIELDS`).

    For the vLLM plugin when vLLM's pool is kvcached's ``ElasticBlockPool``: vLLM's own
    ``BlockPool`` gives the block fields, this gives what only kvcached knows (pages,
    mapped and reserved bytes, what the device can still back). Accepts a kvcached
    ``KVCacheManager`` (or a manager-like object) or its snapshot dict. Not O(1): kvcached
    walks its pages and reads ``cudaMemGetInfo``; sample it at most every 100 ms (kvcached
    itself caches the driver read that long) and copy the values with `apply_page_fields`.
    """
    d = (
        manager_or_dict
        if isinstance(manager_or_dict, Mapping)
        else kvcached_pool_dict(manager_or_dict, integration=integration)
    )
    rec = from_kvcached_dict(d)
    return {name: getattr(rec, name) for name in PAGE_FIELDS}


def apply_page_fields(record: KVCachePoolSnapshot, fields: Mapping[str, Any]) -> None:
    """Copy `page_fields` output onto a pool record (unknown names are ignored)."""
    for name in PAGE_FIELDS:
        if name in fields:
            setattr(record, name, fields[name])
