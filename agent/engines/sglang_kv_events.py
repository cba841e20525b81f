"""SGLang's KV events, recorded into the KV-event segment instead of SGLang's own queue.

SGLang 0.5.23's radix caches report their prefix-cache changes to a
``KVCacheEventRecorder`` (``sglang/srt/mem_cache/events.py``): ``RadixCache.kv_events``,
and ``UnifiedRadixCache.tree_core.kv_events`` (the default tree, the one the tests run):
``record_store(node)`` when an insert adds a node, ``record_remove(node)`` when eviction
deletes one, ``record_all_cleared()`` from ``reset`` (``flush_cache``). Without
``--kv-events-config`` that recorder is disabled and each call returns at once.
`SGLangKVEvents` wraps the three calls on the recorder instance
(SGLang's own call runs first, unchanged) and records what SGLang's enabled recorder would
queue, computed with SGLang's own helpers of that recorder (the node's page hashes, the
LoRA namespace seed, the parent link), so the hashes are SGLang's:

* ``record_store``: per page of the node, a ``BlockStored`` of one block: its hash
  (``hash_str_to_int64`` of SGLang's SHA-256 page hash, namespaced when the node's
  ``extra_key`` names a LoRA adapter), its parent (the previous page's, the parent node's
  last page for the first), the page's token ids (``block_size`` = the page size), the
  LoRA name, medium GPU; the pages of one node are one run (the daemon groups a run into
  one ``BlockStored``);
* ``record_remove``: a ``BlockRemoved`` per page hash of the evicted node;
* ``record_all_cleared``: ``AllBlocksCleared``.

Slots: a cached page is keyed by its hash (a page's hash is what SGLang's stream names;
two nodes can carry one hash when their ``extra_key``s differ but name no LoRA, so a
hash holds a list of slots). Free slots are a FIFO ring with a ring's worth
(``DEFAULT_RING_CAP``) more slots than SGLang has pages, as for vLLM
(agent/engines/vllm/kv_events.py): a freed slot is stored again only after the daemon has
read its last store. The token ids of a page need no device copy (the node's key holds
them); the KV indices (``node.value``) are never read.

Cost: O(pages of the node) per store or eviction, in the scheduler's thread, plus the
page hashes SGLang computes lazily for its own events (SHA-256 per page), which its
enabled recorder computes too. Never raises into SGLang: an error logs once and closes
the segment (the daemon then tells consumers to drop this rank's blocks).

Not recorded: a cache whose recorder is not SGLang's Python ``KVCacheEventRecorder`` (the
Rust tree core's: the agent logs why and records nothing); the events of other media than
GPU (HiCache's host and storage tiers: skipped); a store whose node holds bigram keys
(EAGLE) stops the recording (logged, the segment closed).
"""

from __future__ import annotations

from array import array
from typing import Any

from kvsidecar.protocol import kv_events_layout as kvl

# The recorder's methods wrapped or used (SGLang 0.5.23); without any of them, no events.
RECORDER_HOOKS = (
    "record_store",
    "record_remove",
    "record_all_cleared",
    "_node_event_hash_values",
    "_namespace_seed",
    "_parent_block_hash",
    "lora_names",
    "dynamo_format",
    "page_size",
)


def event_recorder(tree: Any) -> Any:
    """The tree cache's ``KVCacheEventRecorder``: ``RadixCache.kv_events``, or
    ``UnifiedRadixCache.tree_core.kv_events`` (SGLang 0.5.23's default tree on CPU)."""
    rec = getattr(tree, "kv_events", None)
    if rec is None:
        rec = getattr(getattr(tree, "tree_core", None), "kv_events", None)
    return rec


def unsupported(tree: Any) -> str | None:
    """Why this tree cache's events cannot be recorded, or None."""
    if tree is None or getattr(tree, "disable", False):
        return "no radix cache (--disable-radix-cache)"
    rec = event_recorder(tree)
    if type(rec).__name__ != "KVCacheEventRecorder":
        return f"{type(tree).__name__}'s event recorder is {type(rec).__name__}"
    for name in RECORDER_HOOKS:
        if not hasattr(rec, name):
            return f"KVCacheEventRecorder.{name} missing"
    return None


def slots_needed(pages: int) -> int:
    """Slots for every page SGLang can cache at once, plus a ring's worth."""
    return pages + kvl.DEFAULT_RING_CAP


def _gpu(medium: Any) -> bool:
    """SGLang's default medium (None) is GPU; host and storage tiers are not recorded."""
    return medium is None or str(getattr(medium, "value", medium)) == "GPU"


class SGLangKVEvents:
    """Records one SGLang ``RadixCache``'s KV events into a `KVEventsRecorder`."""

    def __init__(self, tree: Any, recorder: Any, n_slots: int) -> None:
        from sglang.srt.disaggregation.kv_events import namespaced_block_hash
        from sglang.srt.mem_cache.utils import hash_str_to_int64

        self.sg = event_recorder(tree)
        self.page = int(self.sg.page_size)
        self.recorder = recorder
        self._ns_hash = namespaced_block_hash
        self._to_int = hash_str_to_int64
        self._slots: dict[int, list[int]] = {}  # page hash -> its slots (one, nearly always)
        self._n_slots = n_slots
        self._reset_free()
        self.active = True
        self._wrap()

    # -- slots: a FIFO of free ones (see the module doc) ----------------------------------

    def _reset_free(self) -> None:
        n = self._n_slots
        self._ring = array("I", range(n))
        self._take_at = 0
        self._free_n = n

    def _take_slot(self, h: int) -> int:
        if not self._free_n:
            raise IndexError(f"all {self._n_slots} KV-event slots in use")
        slot = self._ring[self._take_at % self._n_slots]
        self._take_at += 1
        self._free_n -= 1
        self._slots.setdefault(h, []).append(slot)
        return slot

    def _free(self, slot: int) -> None:
        self._ring[(self._take_at + self._free_n) % self._n_slots] = slot
        self._free_n += 1

    # -- recording ----------------------------------------------------------------------

    def _fail(self, where: str, e: Exception) -> None:
        # Never into SGLang, nor a wrong index left with consumers: the recorder logs and
        # closes the segment (the daemon sends AllBlocksCleared); we stop recording.
        self.active = False
        self.recorder._fail(where, e)

    def _page_hashes(self, node: Any) -> tuple[list[int], Any]:
        """SGLang's published hash of each page of ``node`` (``record_store``'s), and the
        namespace seed."""
        sg = self.sg
        values = sg._node_event_hash_values(node)
        seed = sg._namespace_seed(node)
        ns, to_int = self._ns_hash, self._to_int
        n_pages = -(-len(node.key) // self.page)
        return [ns(to_int(values[i]), namespace_seed=seed) for i in range(n_pages)], seed

    def stored(self, node: Any, medium: Any) -> None:
        key = node.key
        if key.is_bigram:
            raise ValueError("bigram keys (EAGLE) are not recorded")
        sg = self.sg
        hashes, seed = self._page_hashes(node)
        parent = sg._parent_block_hash(node)
        if parent is not None:
            parent = self._ns_hash(parent, namespace_seed=seed)
        extra = key.extra_key
        lora_name = sg.lora_names.resolve(extra) if sg.dynamo_format else sg.lora_names.get(extra)
        raw, page, rec = key.token_ids, self.page, self.recorder
        n = len(key)
        for i, h in enumerate(hashes):
            start = i * page
            rec.stored(
                self._take_slot(h),
                h,
                parent,
                raw[start : min(start + page, n)],
                first=i == 0,
                medium="GPU",
                lora_name=lora_name,
            )
            parent = h

    def removed(self, node: Any) -> None:
        hashes, _ = self._page_hashes(node)
        slots, rec = self._slots, self.recorder
        for h in hashes:
            held = slots.get(h)
            if not held:
                continue  # not stored while we recorded
            slot = held.pop(0)
            if not held:
                del slots[h]
            rec.removed(slot, h)
            self._free(slot)

    def cleared(self) -> None:
        self._slots.clear()
        self._reset_free()
        self.recorder.cleared()

    # -- the wrappers ---------------------------------------------------------------------

    def _wrap(self) -> None:
        sg, ev = self.sg, self
        orig_store, orig_remove, orig_clear = (
            sg.record_store,
            sg.record_remove,
            sg.record_all_cleared,
        )

        def record_store(node: Any, medium: Any = None, *a: Any, **kw: Any) -> Any:
            ret = orig_store(node, medium, *a, **kw)
            if ev.active and _gpu(medium):
                try:
                    ev.stored(node, medium)
                except Exception as e:
                    ev._fail("record_store", e)
            return ret

        def record_remove(node: Any, medium: Any = None, *a: Any, **kw: Any) -> Any:
            ret = orig_remove(node, medium, *a, **kw)
            if ev.active and _gpu(medium):
                try:
                    ev.removed(node)
                except Exception as e:
                    ev._fail("record_remove", e)
            return ret

        def record_all_cleared(*a: Any, **kw: Any) -> Any:
            ret = orig_clear(*a, **kw)
            if ev.active:
                try:
                    ev.cleared()
                except Exception as e:
                    ev._fail("record_all_cleared", e)
            return ret

        sg.record_store = record_store
        sg.record_remove = record_remove
        sg.record_all_cleared = record_all_cleared
