"""vLLM's KV events, recorded into the KV-event segment instead of vLLM's own queue.

Records exactly the events vLLM's ``BlockPool`` puts on ``kv_event_queue`` when
``enable_kv_cache_events`` is on (vLLM 0.32 and 0.33, ``vllm/v1/core/block_pool.py``),
without vLLM building them: `VllmKVEvents` wraps the pool's methods on the instance (on
top of accounting.py's wrappers) and calls the recorder (agent/kv_events.py):

* ``cache_full_blocks``: one ``BlockStored`` per call, a run of the new full blocks
  (null and masked blocks skipped, as vLLM skips them), each with its block hash (vLLM's
  int form: the hash's low 64 bits), its parent (the previous block's hash), its
  ``block_size`` token ids, the request's LoRA and the pool's medium, in the call's
  KV-cache group; the removals of a partial block promoted to full come first, as in
  vLLM's queue;
* ``cache_partial_block``: a ``BlockStored`` of one partial entry when vLLM emits one
  (the entry was not cached yet): its ``hash_block_size`` token ids and parent;
* ``_remove_cached_block_hashes`` (eviction, promotion, ``evict_blocks``): a
  ``BlockRemoved`` per hash vLLM removed, except in ``move_block_hashes``, where vLLM
  moves the entries to another block and emits nothing;
* ``reset_prefix_cache``: ``AllBlocksCleared`` when the reset happened.

vLLM can hold several hashes on one block (a primary and partial entries) and one hash
on several blocks (duplicates, block_pool.py NOTE #1); each (block, hash) entry is a slot
of the segment of its own (``_slots``), so a slot is never shared and a move keeps the
entry's slot. The segment has ``num_gpu_blocks`` slots times the most hashes one block can
hold (``block_size // hash_block_size`` over the pool's groups), plus a ring's worth
(65,536) so that a freed slot is reused only after the daemon has read it (`_take_slot`),
and the largest group's ``block_size`` token ids per slot.

Cost: O(blocks the wrapped call touches), no scan; nothing when the pool's call caches or
evicts nothing but a check. Never raises into vLLM: an error logs once and closes the
segment (the daemon then tells consumers to drop this rank's blocks).
"""

from __future__ import annotations

from array import array
from typing import Any

from kvsidecar.agent.engines.vllm.hooks import _log_once
from kvsidecar.protocol import kv_events_layout as kvl

MASK64 = (1 << 64) - 1

# The BlockPool methods wrapped here (vLLM 0.32 and 0.33); without any of them, no events.
EVENT_HOOKS = (
    "cache_full_blocks",
    "cache_partial_block",
    "_insert_block_hash",
    "_remove_cached_block_hashes",
    "move_block_hashes",
    "reset_prefix_cache",
    "hash_block_size",
    "cached_block_hash_to_block",
)


def _hash_int(block_hash: bytes) -> int:
    """vLLM's int form of a block hash (``maybe_convert_block_hash``, the default
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low 64 bits, big-endian."""
    return int.from_bytes(block_hash, "big") & MASK64


def _key_hash_int(key: bytes) -> int:
    # BlockHashWithGroupId: the hash bytes, then the group id as 4 bytes big-endian.
    return int.from_bytes(key[:-4], "big") & MASK64


def _key_group(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big")


def slots_needed(pool: Any, block_sizes: list[int]) -> int:
    """Slots for every (block, hash) entry the pool can hold at once, plus a ring's worth
    (`VllmKVEvents` reuses a freed slot last: see there)."""
    hash_bs = int(getattr(pool, "hash_block_size", 0) or 0)
    per_block = max((bs // hash_bs for bs in block_sizes if hash_bs and bs), default=1)
    return int(pool.num_gpu_blocks) * max(per_block, 1) + kvl.DEFAULT_RING_CAP


class VllmKVEvents:
    """Records one vLLM ``BlockPool``'s KV events into a `KVEventsRecorder`."""

    def __init__(self, pool: Any, recorder: Any, n_slots: int, manager: Any | None = None) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        self.pool = pool
        self.recorder = recorder
        self.medium = getattr(pool, "medium", "GPU")
        # Per group, the spec vLLM's KVCacheManager.take_events writes into a BlockStored
        # (kv_cache_spec_kind, kv_cache_spec_sliding_window), as one name-table string.
        meta = getattr(manager, "kv_cache_event_metadata", None) or ()
        self._specs = [kind if window is None else f"{kind} {window}" for kind, window in meta]
        self._resolve = resolve_block_hashes
        self._slots: dict[tuple[int, bytes], int] = {}  # (block id, hash key) -> slot
        self._n_slots = n_slots
        self._reset_free()
        self._inserted: list[tuple[bytes, Any]] | None = None  # inserts of the call
        self._moving: dict[bytes, int | None] | None = None  # move_block_hashes' entries
        self.active = True
        self._wrap()

    @staticmethod
    def missing(pool: Any) -> str | None:
        """The first hook this pool lacks (then no events), or None."""
        for name in EVENT_HOOKS:
            if not hasattr(pool, name):
                return f"BlockPool.{name}"
        return None

    # -- recording -------------------------------------------------------------------

    def _fail(self, where: str, e: Exception) -> None:
        # Our bug must never reach vLLM, nor leave a wrong index with consumers: stop
        # recording and close the segment (the daemon sends AllBlocksCleared).
        _log_once(
            f"kv_events.{where}",
            "kvsidecar KV events stopped (engine unaffected): %s: %r",
            where,
            e,
        )
        self.active = False
        self._inserted = self._moving = None
        self.recorder.close()

    # Free slots as a FIFO ring: a freed slot is taken again only after every other free
    # one, and there are a ring's worth (DEFAULT_RING_CAP) more slots than entries, so a
    # slot is stored again only ring_cap records after its last store: by then the daemon
    # has read that store's slot, or fell a ring behind and rebuilds from the table. So the
    # stream never leaves out a stored-then-evicted block (kv-events.md).

    def _reset_free(self) -> None:
        n = self._n_slots
        self._ring = array("I", range(n))
        self._take_at = 0  # the next free slot: _ring[_take_at % n]
        self._free_n = n

    def _free(self, slot: int) -> None:
        n = self._n_slots
        self._ring[(self._take_at + self._free_n) % n] = slot
        self._free_n += 1

    def _take_slot(self, block_id: int, key: bytes) -> int:
        slot = self._slots.get((block_id, key))
        if slot is None:
            if not self._free_n:
                raise IndexError(f"all {self._n_slots} KV-event slots in use")
            slot = self._ring[self._take_at % self._n_slots]
            self._take_at += 1
            self._free_n -= 1
            self._slots[(block_id, key)] = slot
        return slot

    def _store(
        self,
        block_id: int,
        key: bytes,
        parent: bytes | None,
        token_ids: Any,
        request: Any,
        first: bool,
    ) -> None:
        lora = request.lora_request
        group = _key_group(key)
        specs = self._specs
        self.recorder.stored(
            self._take_slot(block_id, key),
            _key_hash_int(key),
            None if parent is None else _hash_int(parent),
            token_ids,
            first=first,
            group_idx=group,
            medium=self.medium,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            spec=specs[group] if group < len(specs) else None,
        )

    def _cached_full(
        self,
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """The BlockStored vLLM builds at the end of ``cache_full_blocks`` (its arguments)."""
        num_cached, num_full = num_cached_blocks, num_full_blocks
        group_id, mask = kv_cache_group_id, block_mask
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        hashes = self._resolve(request.block_hashes, self.pool.hash_block_size, block_size)
        tokens = request.all_token_ids
        first = True
        for i in range(num_cached, num_full):
            blk = blocks[i]
            if blk.is_null or (mask is not None and not mask[i - num_cached]):
                continue
            key = make_block_hash_with_group_id(hashes[i], group_id)
            parent = hashes[i - 1] if i > 0 else None
            start = i * block_size
            self._store(
                blk.block_id, key, parent, tokens[start : start + block_size], request, first
            )
            first = False

    def _removed(self, block_id: int, keys: list[bytes]) -> None:
        slots, rec = self._slots, self.recorder
        for key in keys:
            slot = slots.pop((block_id, key), None)
            if slot is not None:
                rec.removed(slot, _key_hash_int(key), group_idx=_key_group(key))
                self._free(slot)

    # -- the wrappers ------------------------------------------------------------------

    def _wrap(self) -> None:
        pool = self.pool
        ev = self
        orig_full = pool.cache_full_blocks
        orig_partial = pool.cache_partial_block
        orig_insert = pool._insert_block_hash
        orig_remove = pool._remove_cached_block_hashes
        orig_move = pool.move_block_hashes
        orig_reset = pool.reset_prefix_cache

        def cache_full_blocks(
            request: Any,
            blocks: list[Any],
            num_cached_blocks: int,
            num_full_blocks: int,
            *a: Any,
            **kw: Any,
        ) -> Any:
            # vLLM passes these by keyword: the names are vLLM's.
            ret = orig_full(request, blocks, num_cached_blocks, num_full_blocks, *a, **kw)
            if ev.active and num_cached_blocks < num_full_blocks:
                try:
                    ev._cached_full(request, blocks, num_cached_blocks, num_full_blocks, *a, **kw)
                except Exception as e:
                    ev._fail("cache_full_blocks", e)
            return ret

        def cache_partial_block(
            request: Any, block: Any, num_tokens: int, *a: Any, **kw: Any
        ) -> Any:
            if not ev.active:
                return orig_partial(request, block, num_tokens, *a, **kw)
            ev._inserted = inserted = []
            try:
                ret = orig_partial(request, block, num_tokens, *a, **kw)
            finally:
                ev._inserted = None
            try:
                for key, blk in inserted:  # vLLM emits iff the entry was new (inserted)
                    parent, start = pool._get_partial_block_parent_hash_and_start(
                        request, num_tokens
                    )
                    ev._store(
                        blk.block_id,
                        key,
                        parent,
                        request.all_token_ids[start:num_tokens],
                        request,
                        True,
                    )
            except Exception as e:
                ev._fail("cache_partial_block", e)
            return ret

        def _insert_block_hash(key: Any, block: Any, *a: Any, **kw: Any) -> Any:
            inserted, moving = ev._inserted, ev._moving
            if inserted is None and moving is None:
                return orig_insert(key, block, *a, **kw)
            # reset_prefix_cache replaces the map: look it up each time
            cached = pool.cached_block_hash_to_block.contain(key, block.block_id)
            new = not (block.block_hash == key or cached)
            ret = orig_insert(key, block, *a, **kw)
            if new:
                if inserted is not None:
                    inserted.append((key, block))
                elif moving is not None:  # the entry keeps its slot on its new block
                    slot = moving.pop(key, None)
                    if slot is not None:
                        ev._slots[(block.block_id, key)] = slot
            return ret

        def _remove_cached_block_hashes(block: Any, *a: Any, **kw: Any) -> Any:
            # Hot: once per block get_new_blocks hands out. A block without a primary
            # hash holds none (a secondary hash implies a primary one).
            if block.block_hash is None or not ev.active:
                return orig_remove(block, *a, **kw)
            removed = orig_remove(block, *a, **kw)
            try:
                moving = ev._moving
                if moving is not None:
                    for key in removed:
                        moving[key] = ev._slots.pop((block.block_id, key), None)
                elif removed:
                    ev._removed(block.block_id, removed)
            except Exception as e:
                ev._fail("_remove_cached_block_hashes", e)
            return removed

        def move_block_hashes(src_block: Any, dst_block: Any, *a: Any, **kw: Any) -> Any:
            if not ev.active:
                return orig_move(src_block, dst_block, *a, **kw)
            ev._moving = moving = {}
            try:
                return orig_move(src_block, dst_block, *a, **kw)
            finally:
                ev._moving = None
                try:
                    # Removed and not re-inserted (vLLM never does): gone from the cache,
                    # so gone from the segment's table too.
                    for key, slot in moving.items():
                        if slot is not None:
                            ev.recorder.removed(slot, _key_hash_int(key), group_idx=_key_group(key))
                            ev._free(slot)
                except Exception as e:
                    ev._fail("move_block_hashes", e)

        def reset_prefix_cache(*a: Any, **kw: Any) -> Any:
            ret = orig_reset(*a, **kw)
            if ret and ev.active:
                try:
                    ev._slots.clear()
                    ev._reset_free()
                    ev.recorder.cleared()
                except Exception as e:
                    ev._fail("reset_prefix_cache", e)
            return ret

        for name, fn in (
            ("cache_full_blocks", cache_full_blocks),
            ("cache_partial_block", cache_partial_block),
            ("_insert_block_hash", _insert_block_hash),
            ("_remove_cached_block_hashes", _remove_cached_block_hashes),
            ("move_block_hashes", move_block_hashes),
            ("reset_prefix_cache", reset_prefix_cache),
        ):
            setattr(pool, name, fn)
