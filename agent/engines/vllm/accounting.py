"""vLLM's KV-cache accounting: `VllmPoolSource`, one per distinct ``BlockPool``.

vLLM keeps ``free`` in O(1) (``free_block_queue.num_free_blocks``); everything else is kept
incrementally by wrapping the pool's mutation points on the instance (``get_new_blocks``,
``free_blocks``, ``touch``, ``unpin_blocks``, ``_insert_block_hash``,
``_remove_cached_block_hashes``, ``reset_prefix_cache``) and the scheduler's free path
(``_free_request`` sees a connector deferral, ``_free_blocks`` its release: `VllmSidecar`
in scheduler.py calls `VllmPoolSource.defer` and `release`). Each wrapper costs O(blocks it
touches), like the vLLM method it wraps; nothing scans the pool per step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvsidecar.agent.engines.vllm.hooks import _log_once
from kvsidecar.agent.engines.vllm.kv_events import VllmKVEvents, slots_needed
from kvsidecar.protocol.schema import KVCachePoolSnapshot


def _fail(where: str, e: Exception) -> None:
    # A bug in our bookkeeping must never reach vLLM: log once per hook, keep serving.
    _log_once(f"hook.{where}", "kvsidecar accounting error in %s (engine unaffected): %r", where, e)


def _kv_buffers(spec: Any) -> int:
    # MLA keeps one latent buffer per layer; every other attention spec keeps K and V.
    return 1 if "MLA" in type(spec).__name__ else 2


def backing_bytes(tensors: list[Any], layer_names: set[str]) -> int:
    """Bytes of the allocations that back these layers, each counted once.

    vLLM >= 0.32 places every ``KVCacheTensor`` of one residency in one backing allocation
    of ``size`` bytes (device, and a HiSparse host pool): a pool's groups overlay it, so
    its tensors repeat that size, one entry per group and spec. Older ``KVCacheTensor``s
    (``shared_by``) are allocations of their own.
    """
    backings: dict[object, int] = {}
    for t in tensors:
        placed = getattr(t, "layers", None)
        key: object = bool(getattr(t, "host_resident", False))
        if placed is None:
            placed, key = getattr(t, "shared_by", ()), id(t)
        if layer_names.intersection(placed):
            backings[key] = max(backings.get(key, 0), int(t.size))
    return sum(backings.values())


class VllmPoolSource:
    """`PoolSource` over one vLLM ``BlockPool``, counters kept at mutation time.

    Definitions (checked against a brute-force recount over ``BlockPool.blocks`` and
    ``Scheduler.requests`` after every step by tests/engines/test_vllm_accounting.py):

    * total = ``num_gpu_blocks - 1`` (the null block is never handed out); virtual_blocks
      = ``num_gpu_blocks`` (the storage, null block included, as for every source);
      available = ``free_block_queue.num_free_blocks`` (free + evictable cached);
      allocated = total - available (= non-null blocks with ``ref_cnt > 0``), so
      allocated/total is ``vllm:kv_cache_usage_perc``.
    * mapped_bytes = the backing allocation of the pool's layers, once (`backing_bytes`);
      num_layers = the layers one block holds (the largest of the pool's groups, which
      overlay one storage); so virtual_total_bytes = mapped_bytes and a block's bytes are
      vLLM's bytes per block (tests/engines/test_vllm_pools.py).
    * cached = non-null blocks with ``ref_cnt == 0`` and a block hash (evictable).
    * deferred = requests a connector kept after they finished (still in
      ``Scheduler.requests``) and the distinct non-null blocks they hold in this pool.
    * allocs/frees: non-null blocks entering/leaving ``ref_cnt > 0``;
      evictions: cached blocks whose hash ``get_new_blocks`` dropped to reuse them;
      alloc_failures: ``KVCacheManager.allocate_slots`` calls that returned None.
    * prefix_*_tokens: what ``record_prefix_cache_stats`` records for requests not
      preempted before (vLLM's ``vllm:prefix_cache_queries/hits``), also with stats off.
    """

    def __init__(
        self,
        pool: Any,
        *,
        group_id: int,
        pool_name: str,
        specs: list[Any],
        num_layers: int,
        mapped_bytes: int,
        manager: Any | None,
        managers: list[Any],
    ) -> None:
        self.pool = pool
        self._managers = managers  # single-type managers whose blocks come from this pool
        self._manager = manager
        self._block_sizes = [int(getattr(s, "block_size", 0) or 0) for s in specs]
        self.kv_events: VllmKVEvents | None = None  # attach_kv_events
        spec = specs[0] if specs else None
        buffers = _kv_buffers(spec) if spec is not None else 2
        rows = int(pool.num_gpu_blocks)
        if mapped_bytes and num_layers and mapped_bytes % rows == 0:
            # One block of this pool's storage (vLLM's bytes_per_block): the backing's
            # bytes per row, over the layers one block holds (rounded up where a pool's
            # page sizes differ, so the storage is never more than virtual_total_bytes).
            block_bytes = -(-(mapped_bytes // rows) // (num_layers * buffers))
        else:
            page = int(getattr(spec, "page_size_bytes", 0) or 0) if spec is not None else 0
            block_bytes = page // buffers if buffers else page
        total = rows - 1
        self._total = total
        self._unit = block_bytes * num_layers * buffers
        self._queue = pool.free_block_queue
        self.cached = 0
        self.deferred_requests = 0
        self.deferred_blocks = 0
        self._holders: dict[int, int] = {}  # block id -> deferred requests holding it
        self._since: OrderedDict[str, int] = OrderedDict()  # deferral start, oldest first
        self.stats = KVCachePoolSnapshot(
            pool_name=pool_name,
            group_id=group_id,
            num_layers=num_layers,
            num_kv_buffers=buffers,
            block_size_tokens=int(getattr(spec, "block_size", 0) or 0),
            block_size_bytes=block_bytes,
            total_blocks=total,
            # virtual_* is the storage (schema.md): every block of the pool, null included,
            # the same blocks the KV tensors back (mapped_bytes), never the capacity.
            virtual_blocks=total + 1,
            virtual_per_layer_bytes=(total + 1) * block_bytes * buffers,
            virtual_total_bytes=(total + 1) * block_bytes * buffers * num_layers,
            mapped_bytes=mapped_bytes,
            null_block_reserved=True,
            cached_blocks=0,
            deferred_free_requests=0,
            deferred_free_blocks=0,
            oldest_deferred_free_mono_ns=0,
            allocs_total=0,
            frees_total=0,
            evictions_total=0,
            alloc_failures_total=0 if manager is not None else None,
            prefix_query_tokens_total=0 if manager is not None else None,
            prefix_hit_tokens_total=0 if manager is not None else None,
        )
        self._resync_cached()
        self._wrap_pool()
        if manager is not None:
            self._wrap_manager(manager)

    @classmethod
    def for_manager(cls, manager: Any, kv_cache_config: Any) -> list[VllmPoolSource]:
        """One source per distinct BlockPool (vLLM's KV-cache groups share one pool; a
        HiSparse host group has its own), each with the storage that backs its own groups."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
        # The manager's own pool first ("block_pool", vLLM's kv_cache_usage_perc), even
        # where a HiSparse host group (group 0) has a pool of its own.
        by_pool: dict[int, tuple[Any, list[int], list[Any]]] = {
            id(manager.block_pool): (manager.block_pool, [], [])
        }
        for m in manager.coordinator.single_type_managers:
            pool = m.block_pool
            entry = by_pool.setdefault(id(pool), (pool, [], []))
            entry[1].append(int(getattr(m, "kv_cache_group_id", len(entry[1]))))
            entry[2].append(m)
        if not by_pool[id(manager.block_pool)][1]:
            by_pool[id(manager.block_pool)][1].append(0)
        tensors = list(getattr(kv_cache_config, "kv_cache_tensors", []) or [])
        sources = []
        for i, (pool, group_ids, managers) in enumerate(by_pool.values()):
            own = [groups[g] for g in group_ids if g < len(groups)]
            main = pool is manager.block_pool
            sources.append(
                cls(
                    pool,
                    group_id=min(group_ids),
                    pool_name="block_pool" if i == 0 else f"block_pool_{i}",
                    specs=[g.kv_cache_spec for g in own],
                    # vLLM overlays a pool's groups on one storage (a block belongs to
                    # one group at a time): a block holds the largest group's layers.
                    num_layers=max((len(g.layer_names) for g in own), default=0),
                    mapped_bytes=backing_bytes(
                        tensors, {name for g in own for name in g.layer_names}
                    ),
                    manager=manager if main else None,
                    managers=managers,
                )
            )
        return sources

    # -- the PoolSource -----------------------------------------------------------------

    def snapshot(self) -> KVCachePoolSnapshot:
        s = self.stats
        available = self._queue.num_free_blocks
        allocated = self._total - available
        unit = self._unit
        s.allocated_blocks = allocated
        s.available_blocks = available
        s.cached_blocks = self.cached
        s.allocated_bytes = allocated * unit
        s.available_bytes = available * unit
        s.deferred_free_requests = self.deferred_requests
        s.deferred_free_blocks = self.deferred_blocks
        since = self._since
        s.oldest_deferred_free_mono_ns = next(iter(since.values())) if since else 0
        return s

    # -- KV events (kv_events.py) ---------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Token ids a KV-event slot holds: the largest of the pool's groups' block sizes."""
        return max(self._block_sizes, default=0)

    @property
    def kv_event_slots(self) -> int:
        """Slots of the KV-event segment: every (block, hash) entry the pool can hold."""
        missing = VllmKVEvents.missing(self.pool)
        if missing is not None:
            raise AttributeError(f"this vLLM has no {missing}")
        return slots_needed(self.pool, self._block_sizes)

    def attach_kv_events(self, recorder: Any) -> None:
        """Record the pool's KV events into ``recorder`` (the agent's KVEventsRecorder),
        as vLLM's own BlockPool would emit them; attached before the first request."""
        self.kv_events = VllmKVEvents(self.pool, recorder, self.kv_event_slots, self._manager)

    # -- deferrals ------------------------------------------------------------------------

    def _request_block_ids(self, request_id: str) -> list[int]:
        ids: list[int] = []
        for m in self._managers:
            blocks = m.req_to_blocks.get(request_id) if hasattr(m, "req_to_blocks") else None
            if blocks:
                ids.extend(b.block_id for b in blocks if not b.is_null)
        return ids

    def defer(self, request_id: str, now_ns: int) -> list[int] | None:
        """A finished request keeps its blocks for a connector: count them once."""
        ids = self._request_block_ids(request_id)
        if not ids:
            return None
        holders = self._holders
        added = 0
        for b in ids:
            c = holders.get(b, 0)
            if c == 0:
                added += 1
            holders[b] = c + 1
        self.deferred_blocks += added
        self.deferred_requests += 1
        self._since[request_id] = now_ns
        return ids

    def start_deferral_counters(self, tracks_expiry: bool) -> None:
        """Deferral-end counters from 0; the expiry ones only where the connector says."""
        s = self.stats
        s.deferred_free_ended_total = s.deferred_free_ended_blocks_total = 0
        s.deferred_free_ended_ns_total = 0
        if tracks_expiry:
            s.deferred_free_expired_total = s.deferred_free_expired_blocks_total = 0
            s.deferred_free_expired_ns_total = 0

    def release(self, request_id: str, ids: list[int], expired: bool = False) -> None:
        s = self.stats
        since = self._since.get(request_id)
        if s.deferred_free_ended_total is not None:
            # One clock read per release (not per step): how long this hold lasted.
            held = time.monotonic_ns() - since if since is not None else 0
            s.deferred_free_ended_total += 1
            s.deferred_free_ended_blocks_total += len(ids)
            s.deferred_free_ended_ns_total += held
            if expired and s.deferred_free_expired_total is not None:
                s.deferred_free_expired_total += 1
                s.deferred_free_expired_blocks_total += len(ids)
                s.deferred_free_expired_ns_total += held
        holders = self._holders
        removed = 0
        for b in ids:
            c = holders[b] - 1
            if c == 0:
                del holders[b]
                removed += 1
            else:
                holders[b] = c
        self.deferred_blocks -= removed
        self.deferred_requests -= 1
        self._since.pop(request_id, None)

    # -- BlockPool / KVCacheManager wrappers ---------------------------------------------

    def _resync_cached(self) -> None:
        # Once, at attach (the pool is empty then): the incremental count starts exact.
        self.cached = sum(
            1 for b in self.pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash
        )

    def _wrap_pool(self) -> None:
        pool = self.pool
        stats = self.stats
        src = self

        orig_new = pool.get_new_blocks
        orig_free = pool.free_blocks
        orig_touch = pool.touch
        orig_unpin = pool.unpin_blocks
        orig_insert = pool._insert_block_hash
        orig_remove = pool._remove_cached_block_hashes
        orig_reset = pool.reset_prefix_cache

        def get_new_blocks(num_blocks: int, *a: Any, **kw: Any) -> Any:
            before = src.cached
            ret = orig_new(num_blocks, *a, **kw)
            try:
                stats.allocs_total += len(ret)
                stats.evictions_total += before - src.cached
            except Exception as e:
                _fail("get_new_blocks", e)
            return ret

        # Blocks know their pool when a free may mix pools (vLLM >= 0.32); older ones don't.
        mixed = bool(pool.blocks) and hasattr(pool.blocks[0], "pool")

        def _count_released(blocks: list[Any]) -> None:
            seen: set[int] = set()
            cached = 0
            for b in blocks:
                if (
                    b.ref_cnt == 0
                    and not b.is_null
                    and (not mixed or b.pool is None or b.pool is pool)
                ):
                    bid = b.block_id
                    if bid not in seen:
                        seen.add(bid)
                        if b.block_hash is not None:
                            cached += 1
            stats.frees_total += len(seen)
            src.cached += cached

        def _releasing(orig: Any, name: str) -> Any:
            # free_blocks and unpin_blocks both drop references; count what reached 0.
            def wrapper(blocks: Iterable[Any], *a: Any, **kw: Any) -> Any:
                blocks = blocks if isinstance(blocks, list) else list(blocks)
                ret = orig(blocks, *a, **kw)
                try:
                    _count_released(blocks)
                except Exception as e:
                    _fail(name, e)
                return ret

            return wrapper

        free_blocks = _releasing(orig_free, "free_blocks")
        unpin_blocks = _releasing(orig_unpin, "unpin_blocks")

        def touch(blocks: Any, *a: Any, **kw: Any) -> Any:
            revived: dict[int, bool] = {}
            try:
                for b in blocks:
                    if b.ref_cnt == 0 and not b.is_null:
                        revived[b.block_id] = b.block_hash is not None
            except Exception as e:
                _fail("touch", e)
            ret = orig_touch(blocks, *a, **kw)
            if revived:
                stats.allocs_total += len(revived)
                src.cached -= sum(revived.values())
            return ret

        def _insert_block_hash(key: Any, block: Any, *a: Any, **kw: Any) -> Any:
            if block.ref_cnt == 0 and not block.is_null and block.block_hash is None:
                ret = orig_insert(key, block, *a, **kw)
                if block.block_hash is not None:
                    src.cached += 1
                return ret
            return orig_insert(key, block, *a, **kw)

        def _remove_cached_block_hashes(block: Any, *a: Any, **kw: Any) -> Any:
            # Hot: once per block get_new_blocks hands out. Fast path first: an unhashed or
            # referenced block cannot leave the cached set (a secondary hash implies a
            # primary one in this vLLM).
            if block.block_hash is None or block.ref_cnt:
                return orig_remove(block, *a, **kw)
            ret = orig_remove(block, *a, **kw)
            if block.block_hash is None and not block.is_null:
                src.cached -= 1
            return ret

        def reset_prefix_cache(*a: Any, **kw: Any) -> Any:
            ret = orig_reset(*a, **kw)
            if ret:
                src.cached = 0  # every hash was dropped (only possible with no block in use)
            return ret

        for name, fn in (
            ("get_new_blocks", get_new_blocks),
            ("free_blocks", free_blocks),
            ("unpin_blocks", unpin_blocks),
            ("touch", touch),
            ("_insert_block_hash", _insert_block_hash),
            ("_remove_cached_block_hashes", _remove_cached_block_hashes),
            ("reset_prefix_cache", reset_prefix_cache),
        ):
            setattr(pool, name, fn)

    def _wrap_manager(self, manager: Any) -> None:
        stats = self.stats
        orig_record = manager.record_prefix_cache_stats
        orig_alloc = manager.allocate_slots

        def record_prefix_cache_stats(request: Any, num_hits: int, *a: Any, **kw: Any) -> Any:
            ret = orig_record(request, num_hits, *a, **kw)
            try:
                # vLLM's own filter (stats on or off): lookups run, first admission only.
                if manager.prefix_cache_lookup_enabled(request) and request.num_preemptions == 0:
                    stats.prefix_query_tokens_total += request.num_tokens
                    stats.prefix_hit_tokens_total += num_hits
            except Exception as e:
                _log_once("prefix", "kvsidecar prefix accounting error: %r", e)
            return ret

        def allocate_slots(*a: Any, **kw: Any) -> Any:
            ret = orig_alloc(*a, **kw)
            if ret is None:
                stats.alloc_failures_total += 1
            return ret

        manager.record_prefix_cache_stats = record_prefix_cache_stats
        manager.allocate_slots = allocate_slots
