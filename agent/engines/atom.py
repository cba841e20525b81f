"""ATOM (ROCm/ATOM): the agent inside ATOM's engine core, fed by ATOM's own scheduler.

Checked against ATOM commit ``ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21`` (docs/atom.md). ATOM
has no plugin loader; `kvsidecar.agent.engines.atom_hook` installs `AtomSidecar` into every
``atom.model_engine.scheduler.Scheduler`` when ``KVSIDECAR_ATOM=1``. This module holds what
that sidecar counts and publishes, and imports nothing of ATOM.

Field by field (ATOM's ``collect_metrics()`` key -> ours), all O(1) reads per publish:

* ``kv_blocks_total`` (``BlockPool.num_blocks``) -> ``total_blocks``;
  ``kv_blocks_used`` (``num_used``) -> ``allocated_blocks``; ``kv_blocks_free``
  (``num_free``: vacant + cached) -> ``available_blocks``. ATOM has no null block and no
  reserve ledger: ``reserved_blocks`` = 0.
* ``cached_blocks``: free blocks still reachable by hash (``len(BlockPool._cached)``).
  Not ATOM's ``kv_blocks_indexed``, which also counts live blocks.
* ``requests_running`` / ``requests_waiting``: ``Scheduler.get_request_counts()``;
  ``preemptions`` (``Scheduler.total_preemptions``) -> runtime ``preemptions_total``.
* Prefix cache (``cache.full_tokens`` / ``cache.cached_tokens``, tokens as vLLM counts them)
  -> ``prefix_query_tokens_total`` / ``prefix_hit_tokens_total``; null without prefix caching.
* Deferred frees, PR #3238's ``requests_deferred_free`` / ``kv_cache_blocks_deferred_free``:
  `DeferredFrees` replaces ``Scheduler.deferred_free_blocks`` with a dict that counts, at
  insert and removal, how many deferred requests hold each block, so shared blocks count
  once, and when each request began deferring (ATOM records no such time).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from kvsidecar.agent.engines._patching import LogOnce
from kvsidecar.protocol.schema import KVCachePoolSnapshot

log = logging.getLogger("atom.kvsidecar")
_log_once = LogOnce(log)

CHECKED_COMMIT = "ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21"
ROLE_BY_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def block_ids(seq: Any) -> tuple[int, ...]:
    """The physical blocks a deferred entry holds: its ``block_table`` (list or array('i')).

    ATOM's own tests defer objects that are not Sequences (a SimpleNamespace): no table, none.
    """
    table = getattr(seq, "block_table", None)
    return tuple(int(b) for b in table) if table else ()


class DeferredFrees(dict):
    """``Scheduler.deferred_free_blocks`` that keeps PR #3238's two counts as it changes.

    A plain dict to ATOM (same keys, values, order). Besides, per key the block ids held at
    insert, and per block how many deferred requests hold it: ``blocks`` is the number of
    distinct physical blocks (shared prefix blocks once), read in O(1). ``requests`` counts
    the keys holding at least one block and ``oldest_ns`` is the ``CLOCK_MONOTONIC`` time
    the longest-deferred of them was inserted (0: none): an entry holding no block is in
    the dict but deferred in no count (schema.md). Re-setting a key that holds blocks
    keeps its start time: it has been deferred since then.
    """

    def __init__(self, items: Any = (), clock: Callable[[], int] = time.monotonic_ns) -> None:
        super().__init__()
        self._clock = clock
        self._held: dict[Any, tuple[int, ...]] = {}
        self._refs: dict[int, int] = {}
        self._since: OrderedDict[Any, int] = OrderedDict()  # insertion order = age order
        self.update(items)

    # -- counts ------------------------------------------------------------------------

    @property
    def blocks(self) -> int:
        return len(self._refs)

    @property
    def requests(self) -> int:
        return len(self._since)

    @property
    def oldest_ns(self) -> int:
        since = self._since
        return next(iter(since.values())) if since else 0

    # -- bookkeeping (never raises into ATOM) -----------------------------------------

    def _hold(self, key: Any, seq: Any) -> None:
        try:
            old = self._held.get(key)
            if old is not None:
                self._drop(old)
            ids = block_ids(seq)
            if not ids:
                self._since.pop(key, None)
            elif key not in self._since:
                self._since[key] = self._clock()
            self._held[key] = ids
            refs = self._refs
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        except Exception as e:
            _log_once("hold", "kvsidecar deferral tracking failed (engine unaffected): %r", e)

    def _drop(self, ids: Iterable[int]) -> None:
        refs = self._refs
        for b in ids:
            n = refs.get(b, 0) - 1
            if n > 0:
                refs[b] = n
            else:
                refs.pop(b, None)

    def _forget(self, key: Any) -> None:
        try:
            ids = self._held.pop(key, None)
            if ids is not None:
                self._drop(ids)
            self._since.pop(key, None)
        except Exception as e:
            _log_once("forget", "kvsidecar deferral tracking failed (engine unaffected): %r", e)

    # -- the dict methods that change membership --------------------------------------

    def __setitem__(self, key: Any, seq: Any) -> None:
        super().__setitem__(key, seq)
        self._hold(key, seq)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._forget(key)

    _MISSING = object()

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        if key in self:
            value = super().pop(key)
            self._forget(key)
            return value
        if default is DeferredFrees._MISSING:
            raise KeyError(key)
        return default

    def popitem(self) -> tuple[Any, Any]:
        key, value = super().popitem()
        self._forget(key)
        return key, value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return super().__getitem__(key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        super().clear()
        self._held.clear()
        self._refs.clear()
        self._since.clear()

    def __ior__(self, other: Any) -> DeferredFrees:
        self.update(other)
        return self


def _opt_int(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None) if obj is not None else None
    return int(value) if value is not None else None


class AtomPoolSource:
    """`PoolSource` over one ATOM scheduler's ``BlockManager.kv`` pool (see the module doc)."""

    def __init__(self, scheduler: Any, pool_name: str = "block_pool") -> None:
        self._scheduler = scheduler
        self._kv = scheduler.block_manager.kv
        self.deferred = adopt_deferred(scheduler)
        config = getattr(scheduler, "config", None)
        self.stats = KVCachePoolSnapshot(
            pool_name=pool_name,
            block_size_tokens=int(getattr(config, "kv_cache_block_size", 0) or 0),
            null_block_reserved=False,
            reserved_blocks=0,
            deferred_free_requests=0,
            deferred_free_blocks=0,
            oldest_deferred_free_mono_ns=0,
        )
        self.snapshot()

    def current_deferred(self) -> DeferredFrees:
        """The scheduler's deferral dict, adopted again if ATOM (or a test) replaced it."""
        if self._scheduler.deferred_free_blocks is not self.deferred:
            self.deferred = adopt_deferred(self._scheduler)
        return self.deferred

    def snapshot(self) -> KVCachePoolSnapshot:
        kv, s, sched = self._kv, self.stats, self._scheduler
        d = self.current_deferred()
        s.total_blocks = kv.num_blocks
        s.allocated_blocks = kv.num_used
        s.available_blocks = kv.num_free
        cached = getattr(kv, "_cached", None)
        s.cached_blocks = len(cached) if cached is not None else None
        s.deferred_free_requests = d.requests
        s.deferred_free_blocks = d.blocks
        s.oldest_deferred_free_mono_ns = d.oldest_ns
        stats = sched.cache_stats
        s.prefix_query_tokens_total = _opt_int(stats, "total_full_tokens")
        s.prefix_hit_tokens_total = _opt_int(stats, "total_cached_tokens")
        return s


def adopt_deferred(scheduler: Any) -> DeferredFrees:
    """Put a `DeferredFrees` (with the current entries) in ``scheduler.deferred_free_blocks``."""
    d = scheduler.deferred_free_blocks
    if not isinstance(d, DeferredFrees):
        d = DeferredFrees(d)
        scheduler.deferred_free_blocks = d
    return d


def atom_version() -> str:
    try:
        import atom

        version = getattr(atom, "__version__", None)
        if version:
            return str(version)
        from importlib.metadata import version as dist_version

        return dist_version("atom")
    except Exception:
        return "unknown"


def identity(config: Any) -> dict[str, Any]:
    """Agent arguments from ATOM's ``Config`` (missing attributes: the defaults)."""
    par = getattr(config, "parallel_config", None)
    kv_transfer = getattr(config, "kv_transfer_config", None) or {}
    kv_role = kv_transfer.get("kv_role") if isinstance(kv_transfer, dict) else None
    dp_rank = int(getattr(par, "data_parallel_rank", 0) or 0)
    return {
        "engine": "atom",
        "engine_version": atom_version(),
        "model_name": str(getattr(config, "model", "") or ""),
        "role": ROLE_BY_KV_ROLE.get(kv_role, "both"),
        "dp_rank": dp_rank,
        "dp_size": max(int(getattr(par, "data_parallel_size", 1) or 1), dp_rank + 1),
        "tp_size": int(getattr(config, "tensor_parallel_size", 1) or 1),
        "pp_size": int(getattr(config, "pipeline_parallel_size", 1) or 1),
    }


class AtomSidecar:
    """The agent and pool source of one ATOM scheduler (one engine core, one DP rank)."""

    def __init__(self, agent: Any, source: AtomPoolSource) -> None:
        self.agent = agent
        self.source = source

    @classmethod
    def attach(cls, scheduler: Any) -> AtomSidecar | None:
        """Start publishing `scheduler`; None (agent disabled) if that cannot be done."""
        from kvsidecar.agent.agent import KVSidecarAgent

        ident = identity(getattr(scheduler, "config", None))
        # Heartbeat: an idle ATOM engine core does not step; keep the last snapshot fresh.
        agent = KVSidecarAgent(**ident, heartbeat_interval=1.0)
        if not agent.enabled:  # no segment: leave ATOM's scheduler exactly as it was
            return None
        try:
            source = AtomPoolSource(scheduler)
            registered = agent.register_pool(source)
        except Exception:
            registered = False
        if not registered:
            agent.close()
            if isinstance(scheduler.deferred_free_blocks, DeferredFrees):
                scheduler.deferred_free_blocks = dict(scheduler.deferred_free_blocks)
            return None
        sidecar = cls(agent, source)
        sidecar.publish(scheduler, engine_step=False)  # visible before the first step
        log.info(
            "kvsidecar: publishing ATOM %s engine core (dp_rank %d) to %s",
            ident["engine_version"],
            ident["dp_rank"],
            agent.segment_path,
        )
        return sidecar

    def publish(self, scheduler: Any, engine_step: bool = True) -> None:
        try:
            agent = self.agent
            if not engine_step:
                agent.runtime.step -= 1  # a republish (KV transfers done), not a new step
            running, waiting = scheduler.get_request_counts()
            preemptions = getattr(scheduler, "total_preemptions", None)
            agent.runtime.preemptions_total = None if preemptions is None else int(preemptions)
            agent.step(running, waiting, self.source.current_deferred().requests)
        except Exception as e:
            _log_once("publish", "kvsidecar publish failed (engine unaffected): %r", e)

    def close(self) -> None:
        try:
            self.agent.close()
        except Exception as e:
            _log_once("close", "kvsidecar close failed: %r", e)
