"""A real paged KV cache in torch, with O(1) monitoring counters kept at mutation time.

`KVBlockPool` owns per-layer K/V storage ``[num_kv_buffers, rows, block_size, kv_heads,
head_dim]`` (``rows`` = usable blocks + the null block 0), a block allocator (free-list
stack, reference counts, prefix cache with LRU eviction, kvcached-style reserve ledger and
grow/shrink) and a request table (prompt allocation with prefix reuse, decode append,
finish/abort with deferred free until every KV connector releases, early-release leases).

Every mutating call updates ``pool.stats`` (a live `KVCachePoolSnapshot`) before it returns,
so ``pool.snapshot()`` is a field read: the publisher encodes it every engine step.

Counter definitions (``pool.stats``), all in blocks unless named ``*_bytes``:

* ``total_blocks``: current capacity, excluding the null block. A shrink that cannot
  complete yet leaves it at the old value until it completes (``in_shrink``).
* ``allocated_blocks``: blocks with refcount > 0 (held by a live or deferred request, a
  lease or `alloc_blocks`) plus the reserve ledger. Includes ``reserved_blocks``.
* ``reserved_blocks``: blocks in the reserve ledger (`try_to_reserve`).
* ``cached_blocks``: unreferenced blocks that still hold a registered prefix hash;
  evictable (LRU), counted in ``available_blocks``, not in ``allocated_blocks``.
* ``available_blocks``: ``reserved + max(0, cap - allocated)`` where ``cap`` is
  ``total_blocks``, or ``shrink_target_blocks`` while ``in_shrink``. Outside a shrink this
  is free + cached + reserved; during a shrink the capacity above the target is excluded.
* ``deferred_free_requests``: finished/aborted requests waiting on >= 1 connector and
  holding >= 1 block of this pool (one holding none is deferred but not counted).
* ``deferred_free_blocks``: distinct blocks in those requests' tables (shared prefix blocks
  counted once, even if a live request shares them too). Leases are not deferred.
* ``oldest_deferred_free_mono_ns``: CLOCK_MONOTONIC when the oldest still-deferred request
  was finished; 0 when none is deferred.
* ``tokens_used``: token slots filled in blocks with refcount > 0 (a shared block once).
* ``allocs_total``: block transitions into the allocated set: fresh blocks handed to a
  request, to `alloc_blocks` or to the reserve ledger, and cached blocks revived by a prefix
  hit. Draining the ledger into a request is not counted again.
* ``frees_total``: block transitions out of the allocated set (refcount reaching 0, ledger
  release). So ``allocs_total - frees_total == allocated_blocks`` at all times.
* ``evictions_total``: cached blocks dropped from the prefix cache to make room (allocation
  or a shrink).
* ``alloc_failures_total``: calls refused for lack of room (`allocate_prompt`,
  `append_slots`, `alloc_blocks`, `try_to_reserve`); one per call, not per block.
* ``prefix_queries_total``: full prompt blocks looked up; the lookup stops at the first
  miss, which is counted. ``prefix_hits_total``: of which found.
* ``prefix_query_tokens_total``: prompt tokens looked up (every token of the prompt, vLLM's
  unit); ``prefix_hit_tokens_total``: tokens in the blocks found. The two ratios differ.
* ``block_size_bytes``: block_size x kv_heads x head_dim x itemsize (one layer, one buffer).
  ``*_bytes`` = blocks x block_size_bytes x num_layers x num_kv_buffers.
* ``virtual_blocks``: the storage rows, null block included (this pool's reservation,
  kvcached's meaning: it grows with `resize` and is never given back by a shrink, so it
  differs from ``total_blocks``, the current usable capacity).
  ``virtual_per_layer_bytes`` = virtual_blocks x block_size_bytes x num_kv_buffers;
  ``virtual_total_bytes`` = that x num_layers (= ``mapped_bytes``: every row is backed).
* ``mapped_bytes``: storage actually allocated, null block included:
  rows x block_size_bytes x num_layers x num_kv_buffers. Storage grows with `resize` and is
  never given back by a shrink (like kvcached's reserved pages until ``trim()``).

Invalid input never half-applies: every mutating method validates everything first (ids
inside the pool, counts that are integers, references the caller really holds) and raises
ValueError/TypeError/KeyError with the pool unchanged, or mutates completely. In
particular `free_blocks` only drops references `alloc_blocks` handed out, so it can never
free another request's block.

Not thread-safe: call it from the engine thread that also publishes the snapshot.
"""

from __future__ import annotations

import operator
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

import torch

from kvsidecar.protocol.schema import KVCachePoolSnapshot

if TYPE_CHECKING:
    from kvsidecar.agent.kv_events import KVEventsRecorder

# A block table (or token id list) may be any of these; all are accepted wherever one is passed.
BlockTable = Sequence[int] | array | torch.Tensor
TableKind = Literal["list", "array", "tensor"]

NULL_BLOCK = 0
# Parent hash of a request's first block. A constant, because hash(None) varies per process
# before Python 3.12.
_ROOT_HASH = 0x6B76_7369_6465


def hash_block_tokens(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """Chained hash of one full block (vLLM's scheme): it depends on every earlier token."""
    return hash((parent_hash, tokens))


def as_int_list(ids: BlockTable) -> list[int]:
    """A list view of a block table or token ids given as list, array('i') or int tensor."""
    if isinstance(ids, list):
        return ids
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).tolist()
    return list(ids)


def convert_table(ids: Sequence[int], kind: TableKind) -> BlockTable:
    if kind == "list":
        return list(ids)
    if kind == "array":
        return array("i", ids)
    if kind == "tensor":
        return torch.tensor(list(ids), dtype=torch.int32)
    raise ValueError(f"unknown block table kind {kind!r}")


def _integer(value: object, what: str) -> int:
    """operator.index (ints, numpy/torch integers): floats and strings are refused."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None


class DeferredRequests:
    """Distinct deferred request ids across pools (a request deferring in k pools counts
    once). Pools that support it (`KVBlockPool.track_deferred`) report to it at mutation
    time, so the per-step read is ``len()``."""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}  # request id -> pools deferring it

    def add(self, req_id: str) -> None:
        self.ids[req_id] = self.ids.get(req_id, 0) + 1

    def discard(self, req_id: str) -> None:
        n = self.ids.get(req_id, 0) - 1
        if n > 0:
            self.ids[req_id] = n
        elif n == 0:
            del self.ids[req_id]

    def __len__(self) -> int:
        return len(self.ids)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Request:
    __slots__ = ("hashes", "num_tokens", "pending", "req_id", "table", "tokens")

    def __init__(self, req_id: str, table: list[int], num_tokens: int) -> None:
        self.req_id = req_id
        self.table = table  # block ids, position order
        self.num_tokens = num_tokens
        # Tokens of the partial last block, kept while later full blocks can still be hashed.
        self.tokens: list[int] | None = None
        self.hashes: list[int] = []  # chained hashes of the full blocks so far
        self.pending: set[str] | None = None  # connectors still to release, once deferred


class KVBlockPool:
    """Paged K/V storage + block allocator + request table; see the module doc for counters.

    ``num_blocks`` is the usable capacity (``total_blocks``); storage has one more row, the
    null block 0, which is never handed out. ``device=None`` picks cuda when available.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_kv_buffers: int = 2,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device | None = None,
        pool_name: str = "block_pool",
        group_id: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_kv_buffers not in (1, 2):
            raise ValueError("num_kv_buffers is 2 (K and V, MHA/GQA) or 1 (MLA)")
        if num_blocks < 0 or block_size <= 0 or num_layers <= 0:
            raise ValueError("num_blocks >= 0, block_size > 0 and num_layers > 0 required")
        self.block_size = block_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.num_kv_buffers = num_kv_buffers
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else default_device()
        self.enable_prefix_caching = enable_prefix_caching
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.block_size_bytes = block_size * kv_heads * head_dim * itemsize
        # Bytes of one block across every layer and buffer: the unit of every *_bytes field.
        self._unit_bytes = self.block_size_bytes * num_layers * num_kv_buffers

        rows = num_blocks + 1
        self._rows = rows
        self._kv: list[torch.Tensor] = [self._new_storage(rows) for _ in range(num_layers)]
        self._refcount = [0] * rows
        self._raw_refs = [0] * rows  # references handed out by alloc_blocks (free_blocks' own)
        self._fill = [0] * rows  # token slots written per block
        self._deferred_holders = [0] * rows  # deferred requests whose table holds the block
        self._block_hash: list[int | None] = [None] * rows  # set iff _hash_to_block maps back
        self._hash_to_block: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first, unreferenced only
        self._free = list(range(rows - 1, 0, -1))  # stack; pop() hands out low ids first
        self._reserve: list[int] = []
        self._n_used = 0  # blocks with refcount > 0
        self._total = num_blocks
        self._in_shrink = False
        self._target = 0
        self._requests: dict[str, _Request] = {}
        self._leases: dict[int, list[int]] = {}
        self._next_lease = 1
        self._deferred_requests = 0  # deferred and holding a block: the published count
        self._pending = 0  # every deferred request, blockless ones too: none is running
        self._deferred_blocks = 0
        # Deferral start per deferred request, oldest first: the oldest is O(1) to read, and
        # releases in any order are O(1) to remove (an OrderedDict is a linked list).
        self._deferred_since: OrderedDict[str, int] = OrderedDict()
        self._tokens_used = 0
        self._trackers: list[DeferredRequests] = []
        self._events: KVEventsRecorder | None = None  # attach_kv_events

        self.stats = KVCachePoolSnapshot(
            pool_name=pool_name,
            group_id=group_id,
            num_layers=num_layers,
            num_kv_buffers=num_kv_buffers,
            block_size_tokens=block_size,
            block_size_bytes=self.block_size_bytes,
            null_block_reserved=True,
            # Optional in the schema (None = unsupported); this pool supports them all.
            cached_blocks=0,
            deferred_free_requests=0,
            deferred_free_blocks=0,
            oldest_deferred_free_mono_ns=0,
            tokens_used=0,
            allocs_total=0,
            frees_total=0,
            evictions_total=0,
            alloc_failures_total=0,
            prefix_queries_total=0,
            prefix_hits_total=0,
            prefix_query_tokens_total=0,
            prefix_hit_tokens_total=0,
        )
        self._publish_geometry()
        self._publish()

    # ------------------------------------------------------------------ storage

    def _new_storage(self, rows: int) -> torch.Tensor:
        # zeros, not empty: the pages are really touched, so mapped_bytes is honest.
        shape = (self.num_kv_buffers, rows, self.block_size, self.kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def kv_cache(self, layer: int) -> torch.Tensor:
        """Layer storage ``[num_kv_buffers, rows, block_size, kv_heads, head_dim]``.

        Row 0 is the null block. A `resize` that grows storage replaces the tensor.
        """
        return self._kv[layer]

    def slot_indices(self, block_table: BlockTable, start: int, end: int) -> torch.Tensor:
        """Flat slot ids (block * block_size + offset) of token positions [start, end).

        ValueError for an id outside the storage or positions past the table: a negative id
        would wrap to another block, and on a GPU an out-of-range one is a device assert.
        """
        ids = as_int_list(block_table)
        if ids and (min(ids) < 0 or max(ids) >= self._rows):
            raise ValueError(f"block table holds ids outside this pool (0..{self._rows - 1})")
        if start < 0 or end < start or end > len(ids) * self.block_size:
            raise ValueError(f"positions [{start}, {end}) are not covered by the block table")
        table = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.arange(start, end, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write_kv(
        self,
        layer: int,
        block_table: BlockTable,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
        start: int = 0,
    ) -> None:
        """Store K (and V) ``[n, kv_heads, head_dim]`` for positions [start, start+n)."""
        flat = self._kv[layer].view(self.num_kv_buffers, -1, self.kv_heads, self.head_dim)
        if self.num_kv_buffers == 2 and (v is None or v.shape != k.shape):
            raise ValueError("this pool stores K and V: pass v shaped like k")  # before any write
        slots = self.slot_indices(block_table, start, start + k.shape[0])
        flat[0].index_copy_(0, slots, k.to(device=self.device, dtype=self.dtype))
        if self.num_kv_buffers == 2:
            flat[1].index_copy_(0, slots, v.to(device=self.device, dtype=self.dtype))

    def read_kv(
        self, layer: int, block_table: BlockTable, num_tokens: int, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gather K (and V, None for MLA) of positions [start, start+num_tokens)."""
        flat = self._kv[layer].view(self.num_kv_buffers, -1, self.kv_heads, self.head_dim)
        slots = self.slot_indices(block_table, start, start + num_tokens)
        k = flat[0].index_select(0, slots)
        v = flat[1].index_select(0, slots) if self.num_kv_buffers == 2 else None
        return k, v

    # ------------------------------------------------------------------ KV events

    @property
    def kv_event_slots(self) -> int:
        """Block ids this pool can hand out now (0 .. rows-1): a KV-event table's size."""
        return self._rows

    def attach_kv_events(self, recorder: KVEventsRecorder | None) -> None:
        """Record every prefix-cache change (cached, evicted, reset) into ``recorder``
        (agent/kv_events.py); None stops. Attach before the first request: blocks cached
        earlier are not in the stream (their token ids are no longer known)."""
        self._events = recorder

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset: forget every cached block (one AllBlocksCleared event). Refused
        (False, nothing changes) while a block is in use, as vLLM refuses."""
        if self._n_used or self._reserve:
            return False
        for b in self._cached:
            self._free.append(b)
        self._cached.clear()
        self._hash_to_block.clear()
        self._block_hash[:] = [None] * len(self._block_hash)
        if self._events is not None:
            self._events.cleared()
        self._publish()
        return True

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> KVCachePoolSnapshot:
        """The live record (no recomputation); encode it before the next mutation."""
        return self.stats

    def _publish_geometry(self) -> None:
        s = self.stats
        s.total_blocks = self._total
        # The reservation is the storage (kvcached's meaning), not the current capacity.
        s.virtual_blocks = self._rows
        s.virtual_per_layer_bytes = self._rows * self.block_size_bytes * self.num_kv_buffers
        s.virtual_total_bytes = s.virtual_per_layer_bytes * self.num_layers
        s.mapped_bytes = self._rows * self._unit_bytes
        s.in_shrink = self._in_shrink
        s.shrink_target_blocks = self._target if self._in_shrink else None

    def _publish(self) -> None:
        # O(1): a dozen attribute stores from counters kept by the mutating call.
        s = self.stats
        reserved = len(self._reserve)
        allocated = self._n_used + reserved
        room = (self._target if self._in_shrink else self._total) - allocated
        available = reserved + room if room > 0 else reserved
        unit = self._unit_bytes
        s.allocated_blocks = allocated
        s.reserved_blocks = reserved
        s.available_blocks = available
        s.cached_blocks = len(self._cached)
        s.allocated_bytes = allocated * unit
        s.reserved_bytes = reserved * unit
        s.available_bytes = available * unit
        s.deferred_free_requests = self._deferred_requests
        s.deferred_free_blocks = self._deferred_blocks
        since = self._deferred_since
        s.oldest_deferred_free_mono_ns = next(iter(since.values())) if since else 0
        s.tokens_used = self._tokens_used

    # ------------------------------------------------------------------ allocator core

    def _room(self) -> int:
        """Blocks allocatable beyond the ledger: free + evictable cached within capacity."""
        cap = self._target if self._in_shrink else self._total
        room = cap - self._n_used - len(self._reserve)
        return room if room > 0 else 0

    def _take_fresh(self, n: int, out: list[int]) -> None:
        """Append n unallocated blocks to out: free list first, then evict LRU cached.

        The caller has checked n <= _room(). Leaves refcount/counters to the caller.
        """
        free_room = self._total - self._n_used - len(self._reserve) - len(self._cached)
        from_free = n if n <= free_room else max(free_room, 0)
        free = self._free
        fill = self._fill
        for _ in range(from_free):
            b = free.pop()
            fill[b] = 0
            out.append(b)
        evict = n - from_free
        if evict:
            cached = self._cached
            block_hash = self._block_hash
            h2b = self._hash_to_block
            events = self._events
            for _ in range(evict):
                b = cached.popitem(last=False)[0]
                del h2b[block_hash[b]]
                if events is not None:
                    events.removed(b, block_hash[b], group_idx=self.stats.group_id)
                block_hash[b] = None
                fill[b] = 0
                out.append(b)
            self.stats.evictions_total += evict

    def _fits(self, need: int, revive: int = 0) -> bool:
        """Whether need new blocks (after reviving `revive` cached ones) can be had now."""
        fresh = need - len(self._reserve)
        if fresh < 0:
            fresh = 0
        return fresh + revive <= self._room()

    def _alloc_into(self, n: int, out: list[int]) -> None:
        """Hand n blocks (refcount 1) to a holder: the reserve ledger first (kvcached)."""
        reserve = self._reserve
        start = len(out)
        drained = n if n <= len(reserve) else len(reserve)
        for _ in range(drained):
            out.append(reserve.pop())  # already allocated (and empty): no allocs_total
        self._n_used += drained
        fresh = n - drained
        if fresh:
            self._take_fresh(fresh, out)
            self._n_used += fresh
            self.stats.allocs_total += fresh
        refcount = self._refcount
        for i in range(start, len(out)):
            refcount[out[i]] = 1

    def _unref(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced ones go to the cache or free list."""
        refcount = self._refcount
        block_hash = self._block_hash
        cached = self._cached
        free = self._free
        fill = self._fill
        freed = 0
        tokens = 0
        for b in blocks:
            rc = refcount[b] - 1
            if rc < 0:
                raise ValueError(f"block {b} freed more often than allocated")
            refcount[b] = rc
            if rc == 0:
                freed += 1
                tokens += fill[b]
                if block_hash[b] is not None:
                    cached[b] = None  # most recently used end
                else:
                    free.append(b)
        self._n_used -= freed
        self._tokens_used -= tokens
        self.stats.frees_total += freed

    def _evict_to_capacity(self) -> None:
        """Evict LRU cached blocks until allocated + cached fits total (after a shrink)."""
        excess = self._n_used + len(self._reserve) + len(self._cached) - self._total
        if excess <= 0:
            return
        cached = self._cached
        events = self._events
        for _ in range(excess):
            b = cached.popitem(last=False)[0]
            del self._hash_to_block[self._block_hash[b]]
            if events is not None:
                events.removed(b, self._block_hash[b], group_idx=self.stats.group_id)
            self._block_hash[b] = None
            self._free.append(b)
        self.stats.evictions_total += excess

    def _maybe_finish_shrink(self) -> None:
        if self._in_shrink and self._n_used + len(self._reserve) <= self._target:
            self._total = self._target
            self._in_shrink = False
            self._evict_to_capacity()
            self._publish_geometry()

    def alloc_blocks(self, n: int) -> list[int] | None:
        """Low-level: n blocks with refcount 1 for the caller, or None (counted) if no room."""
        n = _integer(n, "n")
        if n < 0:
            raise ValueError("n >= 0")
        if not self._fits(n):
            self.stats.alloc_failures_total += 1
            self._publish()
            return None
        out: list[int] = []
        self._alloc_into(n, out)
        raw = self._raw_refs
        for b in out:
            raw[b] += 1
        self._publish()
        return out

    def _block_ids(self, block_ids: BlockTable) -> list[int]:
        """A private list of valid block ids (1..rows-1; never wrapped); raises otherwise."""
        rows = self._rows
        out = []
        for b in as_int_list(block_ids):
            b = _integer(b, "a block id")
            if not 0 < b < rows:
                raise ValueError(f"block id {b} is outside this pool (1..{rows - 1})")
            out.append(b)
        return out

    def free_blocks(self, block_ids: BlockTable) -> None:
        """Low-level: give back blocks from `alloc_blocks` (one reference per listed id).

        All or nothing: ValueError, with the pool unchanged, if any id is outside the pool
        or is not held through `alloc_blocks` as often as it is listed (a request's,
        a lease's, the null block, or one already freed).
        """
        ids = as_int_list(block_ids)
        raw = self._raw_refs
        rows = self._rows
        taken = 0
        plain = True  # every id a plain int (lists, arrays and tensors give those)
        try:  # one pass: take each reference, undone below if any id is refused
            for b in ids:
                if type(b) is not int:
                    b = _integer(b, "a block id")
                    plain = False
                if not 0 < b < rows:
                    raise ValueError(f"block id {b} is outside this pool (1..{rows - 1})")
                if raw[b] == 0:
                    raise ValueError(
                        f"block {b} is not held through alloc_blocks (often enough): nothing freed"
                    )
                raw[b] -= 1
                taken += 1
        except BaseException:
            for j in range(taken):
                raw[_integer(ids[j], "a block id")] += 1
            raise
        if not plain:
            ids = [_integer(b, "a block id") for b in ids]
        self._unref(ids)
        self._maybe_finish_shrink()
        self._publish()

    # ------------------------------------------------------------------ reserve and resize

    def try_to_reserve(self, n: int) -> bool:
        """Add n blocks to the reserve ledger, taken from free/evictable room (not the ledger).

        They count as allocated and as available; the next allocations drain them first.
        False (one alloc failure) if there is no room.
        """
        n = _integer(n, "n")
        if n < 0:
            raise ValueError("n >= 0")
        if n > self._room():
            self.stats.alloc_failures_total += 1
            self._publish()
            return False
        self._take_fresh(n, self._reserve)
        self.stats.allocs_total += n
        self._publish()
        return True

    def release_reserved(self, n: int) -> int:
        """Return up to n ledger blocks to the free list; returns how many."""
        k = min(max(_integer(n, "n"), 0), len(self._reserve))
        for _ in range(k):
            self._free.append(self._reserve.pop())
        self.stats.frees_total += k
        self._maybe_finish_shrink()
        self._publish()
        return k

    def resize(self, new_total_blocks: int) -> bool:
        """kvcached semantics: True if done now; False if a shrink waits for frees.

        A target >= allocated (growth always) applies at once, evicting cached blocks that
        no longer fit. Below allocated: ``in_shrink`` with that target; ``total_blocks``
        keeps the old value and allocated may not grow until frees complete the shrink.
        """
        new_total_blocks = _integer(new_total_blocks, "new_total_blocks")
        if new_total_blocks < 0:
            raise ValueError("new_total_blocks >= 0")
        if new_total_blocks < self._n_used + len(self._reserve):
            self._in_shrink = True
            self._target = new_total_blocks
            self._publish_geometry()
            self._publish()
            return False
        if new_total_blocks + 1 > self._rows:
            self._grow_storage(new_total_blocks + 1)
        self._total = new_total_blocks
        self._in_shrink = False
        self._target = 0
        self._evict_to_capacity()
        self._publish_geometry()
        self._publish()
        return True

    def _grow_storage(self, rows: int) -> None:
        old = self._rows
        grown = []
        for t in self._kv:  # every layer first: an OOM half-way leaves the pool as it was
            new = self._new_storage(rows)
            new[:, :old].copy_(t)
            grown.append(new)
        self._kv[:] = grown
        extra = rows - old
        self._refcount.extend([0] * extra)
        self._raw_refs.extend([0] * extra)
        self._fill.extend([0] * extra)
        self._deferred_holders.extend([0] * extra)
        self._block_hash.extend([None] * extra)
        self._free.extend(range(rows - 1, old - 1, -1))
        self._rows = rows

    # ------------------------------------------------------------------ requests

    def allocate_prompt(self, req_id: str, token_ids: BlockTable) -> int | None:
        """Allocate a new request's prompt, reusing cached prefix blocks.

        Returns the number of prefix blocks found in the cache (0 is a success), or None
        when there is no room (counted; nothing changes but the prefix query counters).
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already exists")
        tokens = as_int_list(token_ids)
        if not all(type(t) is int for t in tokens):
            # The same rule as append_slots: integers only (float, str, None refused).
            tokens = [_integer(t, "a token id") for t in tokens]
        n = len(tokens)
        bs = self.block_size
        nblocks = -(-n // bs)
        hashes: list[int] = []
        blocks: list[tuple[int, ...]] = []  # each full block's tokens (for KV events)
        table: list[int] = []
        revive = 0
        if self.enable_prefix_caching:
            parent = _ROOT_HASH
            for i in range(n // bs):
                block = tuple(tokens[i * bs : (i + 1) * bs])
                parent = hash_block_tokens(parent, block)
                hashes.append(parent)
                blocks.append(block)
            h2b = self._hash_to_block
            refcount = self._refcount
            for h in hashes:
                b = h2b.get(h)
                if b is None:
                    break
                table.append(b)
                if refcount[b] == 0:
                    revive += 1
            hits = len(table)
            self.stats.prefix_queries_total += hits + (hits < len(hashes))
            self.stats.prefix_hits_total += hits
            # vLLM's token unit: the whole prompt looked up, the cached tokens found.
            self.stats.prefix_query_tokens_total += n
            self.stats.prefix_hit_tokens_total += hits * bs
        hits = len(table)
        need = nblocks - hits
        if not self._fits(need, revive):
            self.stats.alloc_failures_total += 1
            self._publish()
            return None
        if hits:
            refcount = self._refcount
            cached = self._cached
            tokens_back = 0
            for b in table:
                if refcount[b] == 0:  # revived from the cache: allocated again
                    del cached[b]
                    tokens_back += self._fill[b]
                refcount[b] += 1
            self._n_used += revive
            self._tokens_used += tokens_back
            self.stats.allocs_total += revive
        self._alloc_into(need, table)
        fill = self._fill
        for j in range(hits, nblocks):
            fill[table[j]] = min(bs, n - j * bs)
        self._tokens_used += n - hits * bs
        req = _Request(req_id, table, n)
        if self.enable_prefix_caching:
            self._register_hashes(table, hashes, hits, blocks)
            req.hashes = hashes
            req.tokens = tokens[len(hashes) * bs :]
        self._requests[req_id] = req
        self._publish()
        return hits

    def _register_hashes(
        self, table: list[int], hashes: list[int], start: int, blocks: list[tuple[int, ...]]
    ) -> None:
        """Cache blocks start.. of a request; ``blocks[j - (len(hashes) - len(blocks))]``
        holds block j's tokens (the KV event's token ids)."""
        # First writer wins: a hash already mapped (stale chain after an earlier miss) stays.
        h2b = self._hash_to_block
        block_hash = self._block_hash
        events = self._events
        first = True  # a run of newly cached blocks is one BlockStored, as in vLLM
        skip = len(hashes) - len(blocks)
        for j in range(start, len(hashes)):
            h = hashes[j]
            if h not in h2b:
                b = table[j]
                h2b[h] = b
                block_hash[b] = h
                if events is not None:
                    events.stored(
                        b,
                        h,
                        hashes[j - 1] if j else None,
                        blocks[j - skip],
                        first=first,
                        group_idx=self.stats.group_id,
                    )
                first = False
            else:
                first = True

    def append_slots(self, req_id: str, n_tokens: int, token_ids: BlockTable | None = None) -> bool:
        """Room for n more tokens of a running request (decode); False (counted) if none.

        Pass the new token ids to keep hashing full blocks for prefix reuse; without them
        the request's later blocks are not cached.
        """
        req = self._live(req_id)
        n_tokens = _integer(n_tokens, "n_tokens")
        if n_tokens < 0:
            raise ValueError("n_tokens >= 0")
        # Checked now: they are hashed after the blocks are taken, too late to fail.
        ids = (
            None
            if token_ids is None
            else [_integer(t, "a token id") for t in as_int_list(token_ids)]
        )
        if ids is not None and len(ids) != n_tokens:
            raise ValueError("token_ids must hold n_tokens ids")
        bs = self.block_size
        old = req.num_tokens
        new = old + n_tokens
        table = req.table
        need = -(-new // bs) - len(table)
        if need > 0:
            if not self._fits(need):
                self.stats.alloc_failures_total += 1
                self._publish()
                return False
            self._alloc_into(need, table)
        fill = self._fill
        for j in range(old // bs, -(-new // bs)):
            fill[table[j]] = min(bs, new - j * bs)
        req.num_tokens = new
        self._tokens_used += n_tokens
        if req.tokens is not None:
            if ids is None:
                req.tokens = None  # content unknown from here on: stop hashing
            else:
                tail = req.tokens
                tail.extend(ids)
                if len(tail) >= bs:
                    hashes = req.hashes
                    start = len(hashes)
                    parent = hashes[-1] if hashes else _ROOT_HASH
                    blocks = []
                    while len(tail) >= bs:
                        block = tuple(tail[:bs])
                        parent = hash_block_tokens(parent, block)
                        hashes.append(parent)
                        blocks.append(block)
                        del tail[:bs]
                    self._register_hashes(table, hashes, start, blocks)
        self._publish()
        return True

    def _live(self, req_id: str) -> _Request:
        req = self._requests[req_id]
        if req.pending is not None:
            raise ValueError(f"request {req_id!r} is finished (deferred free)")
        return req

    def finish(self, req_id: str, connectors: Iterable[str] = ()) -> bool:
        """Finish a request: free its blocks, or defer the whole request until every named
        connector (e.g. "pd", "offload") calls `release`. Returns True if deferred.

        ``connectors``: names, or one name as a string; none (``()``) frees at once. An
        empty, blank or non-string name raises ValueError before anything changes: it would
        hold the blocks for a connector nobody can name in `release` (and freeing them
        instead could hand out KV that a transfer is still reading)."""
        req = self._live(req_id)
        pending = _connector_names(connectors)
        if pending and not req.table:
            # Holds no block of this pool: deferred for its connectors, but not counted
            # (schema.md: deferral fields count requests holding blocks of the pool).
            req.pending = pending
            self._pending += 1
            return True
        if pending:
            req.pending = pending
            self._pending += 1
            holders = self._deferred_holders
            added = 0
            for b in req.table:
                c = holders[b]
                if c == 0:
                    added += 1
                holders[b] = c + 1
            self._deferred_blocks += added
            self._deferred_requests += 1
            self._deferred_since[req_id] = time.monotonic_ns()
            for tracker in self._trackers:
                tracker.add(req_id)
            self._publish()
            return True
        del self._requests[req_id]
        self._unref(reversed(req.table))  # tail first: it is evicted before the shared prefix
        self._maybe_finish_shrink()
        self._publish()
        return False

    def abort(self, req_id: str, connectors: Iterable[str] = ()) -> bool:
        """Same accounting as `finish` (an aborted request's source KV may still be in flight)."""
        return self.finish(req_id, connectors)

    def release(self, req_id: str, connector: str) -> bool:
        """A connector is done with a deferred request; True when that freed it."""
        req = self._requests[req_id]
        if req.pending is None:
            raise ValueError(f"request {req_id!r} is not deferred")
        if connector not in req.pending:
            raise KeyError(
                f"request {req_id!r} is not pending on connector {connector!r} "
                f"(pending: {sorted(req.pending)})"
            )
        req.pending.remove(connector)
        if req.pending:
            return False
        self._pending -= 1
        if not req.table:
            del self._requests[req_id]
            return True
        holders = self._deferred_holders
        removed = 0
        for b in req.table:
            c = holders[b] - 1
            if c == 0:
                removed += 1
            holders[b] = c
        self._deferred_blocks -= removed
        self._deferred_requests -= 1
        del self._deferred_since[req_id]
        for tracker in self._trackers:
            tracker.discard(req_id)
        del self._requests[req_id]
        self._unref(reversed(req.table))
        self._maybe_finish_shrink()
        self._publish()
        return True

    def lease(self, req_id: str, block_ids: BlockTable) -> int:
        """Early-release lease on some of a request's blocks (e.g. an offload read).

        The blocks stay allocated until `release_lease`, even after the request is freed;
        they are not counted as deferred. Returns the lease id.
        """
        ids = self._block_ids(block_ids)
        owned = set(self._requests[req_id].table)
        for b in ids:
            if b not in owned:
                raise ValueError(f"block {b} is not in request {req_id!r}")
        refcount = self._refcount
        for b in ids:
            refcount[b] += 1
        lease_id = self._next_lease
        self._next_lease += 1
        self._leases[lease_id] = ids
        return lease_id

    def release_lease(self, lease_id: int) -> None:
        self._unref(self._leases.pop(lease_id))
        self._maybe_finish_shrink()
        self._publish()

    # ------------------------------------------------------------------ deferral tracking

    def track_deferred(self, tracker: DeferredRequests) -> None:
        """Report deferred request ids to tracker (the agent's distinct count across pools)."""
        if tracker not in self._trackers:
            self._trackers.append(tracker)
            for req_id in self._deferred_since:
                tracker.add(req_id)

    def untrack_deferred(self, tracker: DeferredRequests) -> None:
        if tracker in self._trackers:
            self._trackers.remove(tracker)
            for req_id in self._deferred_since:
                tracker.discard(req_id)

    # ------------------------------------------------------------------ queries

    def block_table(self, req_id: str, kind: TableKind = "list") -> BlockTable:
        """A copy of the request's block table as list, array('i') or int32 tensor."""
        return convert_table(self._requests[req_id].table, kind)

    def num_tokens(self, req_id: str) -> int:
        return self._requests[req_id].num_tokens

    def is_deferred(self, req_id: str) -> bool:
        return self._requests[req_id].pending is not None

    def pending_connectors(self, req_id: str) -> frozenset[str]:
        return frozenset(self._requests[req_id].pending or ())

    def request_ids(self) -> Iterator[str]:
        return iter(list(self._requests))

    @property
    def num_running(self) -> int:
        """Requests not finished: a deferred one is not running, block or none."""
        return len(self._requests) - self._pending

    @property
    def storage_rows(self) -> int:
        """Rows of K/V storage, the null block included."""
        return self._rows


def _connector_names(connectors: Iterable[str]) -> set[str]:
    """The connector names a deferral waits for; ValueError for an empty, blank or
    non-string one (a string is one name, so ``""`` is an empty name, not "none")."""
    names = [connectors] if isinstance(connectors, str) else list(connectors)
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"connector name {name!r} is not a name: give each connector a non-empty "
                'name (e.g. "pd"), or no connectors (()) to free the blocks at once'
            )
    return set(names)


# ---------------------------------------------------------------------- device memory


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) bytes from /proc/meminfo, sysconf as the fallback."""
    try:
        total = avail = None
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith(b"MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                if total is not None and avail is not None:
                    return total, avail
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


class DeviceMemorySampler:
    """(total_bytes, free_bytes) of a device, cached for ``ttl_s`` (one driver call per window).

    GPU: ``torch.cuda.mem_get_info``. CPU: host MemTotal / MemAvailable.
    """

    def __init__(
        self,
        device: str | torch.device,
        ttl_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = torch.device(device)
        self.ttl_s = ttl_s
        self._clock = clock
        self._at = float("-inf")
        self._value = (0, 0)
        self.reads = 0  # underlying reads done, for tests and self-metrics

    def sample(self) -> tuple[int, int]:
        now = self._clock()
        if now - self._at < self.ttl_s:
            return self._value
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self._value = (int(total), int(free))
        else:
            self._value = host_memory()
        self._at = now
        self.reads += 1
        return self._value


_SAMPLERS: dict[str, DeviceMemorySampler] = {}


def sample_device_memory(device: str | torch.device) -> tuple[int, int]:
    """(total_bytes, free_bytes), shared 100 ms cache per device."""
    key = str(device)
    sampler = _SAMPLERS.get(key)
    if sampler is None:
        sampler = _SAMPLERS[key] = DeviceMemorySampler(device)
    return sampler.sample()
