"""SGLang: a `PoolSource` over SGLang's token-slot allocator and radix (prefix) cache.

SGLang (checked against 0.5.23, ``sglang/srt/mem_cache/``) keeps KV in token slots:
``TokenToKVPoolAllocator`` (page size 1) or ``PagedTokenToKVPoolAllocator`` hands out slot
indices into a ``KVCache`` (``MHATokenToKVPool``: K and V per layer; ``MLATokenToKVPool``:
one buffer), slot/page 0 being a padding slot never handed out. ``ReqToTokenPool`` maps
each request to its slots; ``RadixCache`` keeps finished prefixes (evictable while no
running request locks them, protected while one does). All three quantities SGLang keeps
as O(1) counters, so ``snapshot()`` reads three of them:

* ``allocator.available_size()``: free token slots (free + staged pages x page size);
* ``tree_cache.evictable_size()``: cached slots no request locks (evictable);
* ``tree_cache.protected_size()``: cached slots locked by running requests.

Our record in blocks of SGLang's page size (``block_size_tokens`` = ``page_size``; every
count below is a multiple of it, so ``x block_size_tokens`` gives SGLang's slots exactly):

* ``total_blocks`` = ``max_total_num_tokens // page_size`` (the scheduler's capacity,
  padding page excluded), ``virtual_blocks`` = that + 1 (the padding page is storage too);
* ``available_blocks`` = ``(available_size() + evictable_size()) // page_size`` (ours
  includes evictable cached blocks), ``cached_blocks`` = ``evictable_size() // page_size``;
* ``allocated_blocks`` = ``num_used // page_size`` with SGLang's own formula
  ``num_used = max_total_num_tokens - (available_size() + evictable_size())``
  (``sglang:num_used_tokens`` / ``kv_used_tokens``; ``token_usage`` is
  ``allocated_blocks / total_blocks``);
* ``protected_blocks`` = ``protected_size() // page_size`` (a subset of allocated);
* ``tokens_used`` = ``num_used`` when ``page_size == 1`` (every used slot holds a token);
  null for larger pages, whose unfilled tail slots SGLang does not count in O(1);
* ``reserved_blocks`` = 0 (SGLang has no reserve ledger); deferral, alloc/free counters: null;
* ``prefix_hit_tokens_total`` / ``prefix_query_tokens_total``: the scheduler's own prefill
  counts (`SGLangSidecar.count_prefill`), SGLang's ``realtime_tokens_total`` modes.

Hook point: `SGLangSidecar`, attached to every SGLang scheduler by the ``sglang.srt.plugins``
entry point (``agent/engines/sglang_plugin.py``), publishes after each
``Scheduler.process_batch_result`` and ``Scheduler.on_idle`` (the two branches of every
event-loop iteration); tested against a real SGLang 0.5.23 server on CPU
(tests/engines/test_sglang_server.py).

Hybrid pools (SWA, mamba) and HiCache host tiers are not covered: they have their own
sizes (``swa_available_size`` ...) and would be more pools.
"""

from __future__ import annotations

from typing import Any

from kvsidecar.protocol.schema import KVCachePoolSnapshot


def _buffer_geometry(kvcache: Any, page_size: int) -> tuple[int, int]:
    """(num_kv_buffers, block_size_bytes) of an SGLang KVCache: one page, one layer, one buffer."""
    k = getattr(kvcache, "k_buffer", None)
    if k is not None:  # MHA: K and V per layer
        buffers, first = 2, k[0]
    else:  # MLA: one combined buffer per layer
        buffers, first = 1, kvcache.kv_buffer[0]
    per_slot = first[0].numel() * first.element_size()
    return buffers, per_slot * page_size


class SGLangPoolSource:
    """`PoolSource` over an SGLang allocator + radix cache (see the module doc).

    ``max_total_num_tokens`` is the scheduler's (``Scheduler.max_total_num_tokens``);
    it defaults to the allocator's ``size``, which it equals for a plain pool.
    ``tree_cache`` may be a disabled ``RadixCache`` (nothing evictable) or None.
    """

    def __init__(
        self,
        allocator: Any,
        tree_cache: Any | None,
        *,
        max_total_num_tokens: int | None = None,
        kvcache: Any | None = None,
        pool_name: str | None = None,
        group_id: int = 0,
        kv_events: bool = True,
    ) -> None:
        self._allocator = allocator
        self._tree = tree_cache
        self._kv_events_rank = kv_events  # the rank whose radix cache SGLang would publish
        self.kv_events: Any = None  # attach_kv_events
        page = int(allocator.page_size)
        self._page = page
        self._max_total = int(max_total_num_tokens or allocator.size)
        kv = kvcache if kvcache is not None else allocator.get_kvcache()
        buffers, block_bytes = _buffer_geometry(kv, page)
        layers = int(kv.layer_num)
        self._unit = block_bytes * layers * buffers
        total = self._max_total // page
        rows = total + 1  # the padding slot/page 0 is storage too
        self.stats = KVCachePoolSnapshot(
            pool_name=pool_name or ("mha" if buffers == 2 else "mla"),
            group_id=group_id,
            num_layers=layers,
            num_kv_buffers=buffers,
            block_size_tokens=page,
            block_size_bytes=block_bytes,
            total_blocks=total,
            virtual_blocks=rows,
            virtual_per_layer_bytes=rows * block_bytes * buffers,
            virtual_total_bytes=rows * block_bytes * buffers * layers,
            # SGLang allocates the whole pool up front (torch.zeros on the device).
            mapped_bytes=rows * self._unit,
            null_block_reserved=True,
            cached_blocks=0,
            protected_blocks=0,
            tokens_used=0 if page == 1 else None,
            # Counted by `SGLangSidecar.count_prefill` from the scheduler's own prefill stats.
            prefix_query_tokens_total=0,
            prefix_hit_tokens_total=0,
        )
        self.snapshot()

    # KV events (KVSIDECAR_KV_EVENTS=1): the agent sizes the segment from these, then
    # attaches; agent/engines/sglang_kv_events.py records the radix cache's events.
    @property
    def block_size(self) -> int:
        return self._page

    @property
    def kv_event_slots(self) -> int:
        from kvsidecar.agent.engines import sglang_kv_events as ske

        why = "not SGLang's publishing rank" if not self._kv_events_rank else None
        why = why or ske.unsupported(self._tree)
        if why is not None:
            raise ValueError(why)
        return ske.slots_needed(self._max_total // self._page + 1)

    def attach_kv_events(self, recorder: Any) -> None:
        from kvsidecar.agent.engines.sglang_kv_events import SGLangKVEvents

        self.kv_events = SGLangKVEvents(self._tree, recorder, self.kv_event_slots)

    def snapshot(self) -> KVCachePoolSnapshot:
        # O(1): SGLang keeps all three as counters (len of a tensor, two ints).
        free = self._allocator.available_size()
        tree = self._tree
        evictable = tree.evictable_size() if tree is not None else 0
        protected = tree.protected_size() if tree is not None else 0
        used = self._max_total - (free + evictable)  # SGLang's num_used
        page, unit, s = self._page, self._unit, self.stats
        available = (free + evictable) // page
        allocated = used // page
        s.allocated_blocks = allocated
        s.available_blocks = available
        s.cached_blocks = evictable // page
        s.protected_blocks = protected // page
        s.allocated_bytes = allocated * unit
        s.available_bytes = available * unit
        if page == 1:
            s.tokens_used = used
        return s


def _resolved_args(args: Any) -> dict[str, Any]:
    """SGLang's resolved server arguments. SGLang 0.5.23 keeps the record's fields as given
    (``served_model_name`` stays None without ``--served-model-name``) and publishes what
    its resolution decided (that: the model path) through ``resolved_dict()``, which its
    config bags and so its own metrics labels read. Older SGLang resolved in place."""
    try:
        resolved = args.resolved_dict()
    except Exception:
        resolved = None
    return resolved if isinstance(resolved, dict) else {}


def _identity(scheduler: Any) -> dict[str, Any]:
    """The agent's identity from an SGLang Scheduler (its resolved server_args and ranks)."""
    args = scheduler.server_args
    resolved = _resolved_args(args)

    def arg(name: str, default: Any = None) -> Any:
        value = resolved.get(name)
        return value if value is not None else getattr(args, name, default)

    mode = str(arg("disaggregation_mode", "null") or "null")
    try:
        from sglang.version import __version__ as version
    except Exception:
        version = None
    # SGLang's model_name label: the served model name, else the model path (its own
    # default, handle_missing_default_values), never the string "None".
    model = arg("served_model_name") or arg("model_path")
    device = arg("device")
    return {
        "engine": "sglang",
        "model_name": str(model) if model else "",
        "engine_version": version,
        "role": None if mode == "null" else mode,
        "tp_rank": int(getattr(scheduler, "tp_rank", 0) or 0),
        "tp_size": int(arg("tp_size", 1) or 1),
        "pp_rank": int(getattr(scheduler, "pp_rank", 0) or 0),
        "pp_size": int(arg("pp_size", 1) or 1),
        "dp_rank": int(getattr(scheduler, "dp_rank", 0) or 0),
        "dp_size": int(arg("dp_size", 1) or 1),
        "device": str(device).split(":")[0] if device else None,
    }


class SGLangSidecar:
    """The agent and pool source of one SGLang scheduler process (agent/engines/sglang_plugin)."""

    def __init__(self, agent: Any, source: SGLangPoolSource) -> None:
        self.agent = agent
        self.source = source

    @classmethod
    def attach(cls, scheduler: Any) -> SGLangSidecar | None:
        """Start publishing `scheduler`'s pool; None (agent disabled) if that cannot be done."""
        from kvsidecar.agent.agent import KVSidecarAgent

        # Heartbeat: an idle scheduler may block in its receive; keep the record fresh.
        agent = KVSidecarAgent(**_identity(scheduler), heartbeat_interval=1.0)
        if not agent.enabled:
            return None
        try:
            source = SGLangPoolSource(
                scheduler.token_to_kv_pool_allocator,
                scheduler.tree_cache,
                max_total_num_tokens=scheduler.max_total_num_tokens,
                # SGLang publishes from pp rank 0, attention-TP rank 0 (one per KV cache).
                kv_events=not any(getattr(scheduler, r, 0) for r in ("tp_rank", "pp_rank")),
            )
            registered = agent.register_pool(source)
        except Exception:
            registered = False
        if not registered:
            agent.close()
            return None
        sidecar = cls(agent, source)
        sidecar.publish(scheduler, 0)
        return sidecar

    def count_prefill(self, batch: Any) -> None:
        """Add one prefill batch's prefix-cache lookups, as SGLang's scheduler counted them.

        ``batch.prefill_stats`` is what SGLang's `PrefillAdder` summed at admission and what
        its metrics reporter adds to ``sglang:realtime_tokens_total`` after the batch ran:
        ``log_hit_tokens`` (the radix-cache prefix each admitted request matched:
        ``mode="prefill_cache"``) and ``log_input_tokens`` (what was left to compute,
        ``mode="prefill_compute"`` less SWA replays). Queried = matched + computed. Only
        extend (prefill) batches count, as SGLang reports only those: after its prefill a
        batch object lives on as the running decode batch, ``prefill_stats`` still set.
        A chunked prefill counts the request's radix-cache match once, with its first
        chunk; each later chunk counts no hit and its own tokens as computed (SGLang's
        ``PrefillAdder.add_chunked_req`` charges a prefix of 0), so a request's query total
        is its prompt, chunked or not. A retracted request counts again when readmitted:
        SGLang's units, kept."""
        stats = getattr(batch, "prefill_stats", None)
        if stats is None or not batch.forward_mode.is_extend():
            return
        hit = int(stats.log_hit_tokens)
        s = self.source.stats
        s.prefix_hit_tokens_total += hit  # type: ignore[operator]
        s.prefix_query_tokens_total += hit + int(stats.log_input_tokens)  # type: ignore[operator]

    def publish(self, scheduler: Any, retracted: int) -> None:
        """One scheduler iteration: running/queued as SGLang's own gauges count them."""
        agent = self.agent
        agent.runtime.preemptions_total = retracted
        agent.step(len(scheduler.running_batch.reqs), len(scheduler.waiting_queue))
