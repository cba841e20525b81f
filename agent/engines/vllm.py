"""vLLM: a ``vllm.general_plugins`` entry point that runs the agent in vLLM's engine core.

``register()`` (run by ``vllm.plugins.load_general_plugins()`` in every vLLM process)
wraps ``SchedulerConfig.get_scheduler_cls`` so that it returns a subclass of whatever
scheduler class vLLM chose. Only the engine core builds a scheduler, so the patch does
nothing anywhere else (API server, workers): no agent, no segment, no thread there.

The subclass owns one `KVSidecarAgent` per engine core (= per DP rank) and publishes after
every ``update_from_output`` (once per engine step, empty steps included) plus after the
between-step mutations (``finish_requests`` for aborts, ``reset_prefix_cache``), so the
segment matches the engine at quiescent moments too.

Accounting (`VllmPoolSource`, one per distinct ``BlockPool``): vLLM keeps ``free`` in O(1)
(``free_block_queue.num_free_blocks``); everything else is kept incrementally by wrapping
the pool's mutation points on the instance (``get_new_blocks``, ``free_blocks``, ``touch``,
``unpin_blocks``, ``_insert_block_hash``, ``_remove_cached_block_hashes``,
``reset_prefix_cache``) and the scheduler's free path (``_free_request`` sees a connector
deferral, ``_free_blocks`` its release). Each wrapper costs O(blocks it touches), like the
vLLM method it wraps; nothing scans the pool per step.

The hooks touch private vLLM methods (vLLM says the scheduler interface is not public).
`TESTED_VERSIONS` were checked (docs/vllm.md, "Supported versions"); on another version the
plugin still tries, and if a hook point is missing or its signature differs from
`HOOK_SIGNATURES` it disables itself with one log line naming the version and the hook point.
No exception from this module ever reaches the engine.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvsidecar import settings
from kvsidecar.protocol.schema import KVCachePoolSnapshot

# Under "vllm." so vLLM's own logging configuration (handlers, format, level) shows it.
log = logging.getLogger("vllm.kvsidecar")

TESTED_VERSIONS = ("0.32.0", "0.33.0")

# Hook points, checked before anything is patched: (owner, attribute).
SCHEDULER_HOOKS = ("update_from_output", "_free_request", "_free_blocks", "finish_requests")
BLOCK_POOL_HOOKS = (
    "get_new_blocks",
    "free_blocks",
    "touch",
    "unpin_blocks",
    "_insert_block_hash",
    "_remove_cached_block_hashes",
    "reset_prefix_cache",
    "free_block_queue",
    "num_gpu_blocks",
    "blocks",
)
MANAGER_HOOKS = ("record_prefix_cache_stats", "allocate_slots", "coordinator", "block_pool")

# The parameters (after self) of every wrapped method, as in TESTED_VERSIONS. A hook point
# whose signature differs is treated like a missing one: our wrappers pass arguments through
# by position and read them by meaning, so a changed signature would miscount silently.
HOOK_SIGNATURES: dict[str, dict[str, tuple[str, ...]]] = {
    "Scheduler": {
        "update_from_output": ("scheduler_output", "model_runner_output"),
        "_free_request": ("request", "delay_free_blocks"),
        "_free_blocks": ("request",),
        "finish_requests": ("request_ids", "finished_status"),
        "reset_prefix_cache": ("reset_running_requests", "reset_connector"),
        "shutdown": (),
        "get_request_counts": (),
    },
    "BlockPool": {
        "get_new_blocks": ("num_blocks",),
        "free_blocks": ("ordered_blocks",),
        "touch": ("blocks",),
        "unpin_blocks": ("blocks", "on_reuse"),
        "_insert_block_hash": ("block_hash_with_group_id", "block", "num_tokens"),
        "_remove_cached_block_hashes": ("block",),
        "reset_prefix_cache": (),
    },
    "KVCacheManager": {
        "record_prefix_cache_stats": ("request", "num_hits"),
        "prefix_cache_lookup_enabled": ("request",),
    },
}

ROLE_BY_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}

_PATCH_MARK = "_kvsidecar_patched"
_subclasses: dict[type, type] = {}
_logged: set[str] = set()


def _log_once(key: str, message: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


def _fail(where: str, e: Exception) -> None:
    # A bug in our bookkeeping must never reach vLLM: log once per hook, keep serving.
    _log_once(f"hook.{where}", "kvsidecar accounting error in %s (engine unaffected): %r", where, e)


def _disabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    return settings.DISABLE.enabled(os.environ if env is None else env)


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


class _ToVllmLogger(logging.Handler):
    """Hands the agent's records (logger ``kvsidecar``) to ``vllm.kvsidecar``, so every line
    the plugin logs inside vLLM has vLLM's handlers and format."""

    def emit(self, record: logging.LogRecord) -> None:
        if log.isEnabledFor(record.levelno):  # vLLM's level, read when the line is logged
            record.name = log.name
            log.handle(record)


def _log_through_vllm() -> None:
    root = logging.getLogger("kvsidecar")
    if not any(isinstance(h, _ToVllmLogger) for h in root.handlers):
        root.addHandler(_ToVllmLogger())
        root.propagate = False  # one copy: vLLM's, not a second one from the root logger
        root.setLevel(logging.DEBUG)  # the handler applies vLLM's level (configured later)


def _patch_process_manager() -> None:
    """In the process that starts the engine cores (the API server): once vLLM's process
    manager has stopped them, close the segments they could not close themselves. With
    ``--shutdown-timeout 0`` (the default) it SIGKILLs an engine core right after SIGTERM,
    before ``Scheduler.shutdown()``, and the segment read as a crash."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager
    except Exception:
        return  # not this vLLM layout: engine cores then close only by themselves
    original = getattr(CoreEngineProcManager, "shutdown", None)
    if original is None or getattr(original, _PATCH_MARK, False):
        return

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Only engine cores alive when the stop begins are closed for: vLLM also runs this
        # shutdown to clean up after a core that crashed (killed, OOM, a bug), and a crash
        # must read "dead", never "closed cleanly" (segment-format.md section 5: CLOSED is
        # written for a writer that was alive and being stopped).
        processes = [p for p in getattr(self, "processes", ()) if _alive(p)]
        timeout = kwargs.get("timeout", args[0] if args else None)
        if timeout == 0:
            # SIGKILL follows SIGTERM at once: close first, so no reader sees "writer gone"
            # in between. The engine aborts its requests anyway (nothing left to show).
            _close_for(processes, dead_only=False)
        try:
            return original(self, *args, **kwargs)
        finally:
            _close_for(processes, dead_only=True)

    setattr(shutdown, _PATCH_MARK, True)
    shutdown.__wrapped__ = original  # type: ignore[attr-defined]
    CoreEngineProcManager.shutdown = shutdown  # type: ignore[method-assign]


def _alive(process: Any) -> bool:
    """Not exited nor exiting. The process sentinel (a pipe the kernel closes as the child
    exits) is what vLLM's own liveness monitor waits on before it runs this shutdown after a
    crash; is_alive() (waitpid) can still say True for a moment then, and did."""
    try:
        from multiprocessing.connection import wait

        return not wait([process.sentinel], timeout=0)
    except Exception:
        return False


def _close_for(processes: list[Any], dead_only: bool) -> None:
    try:
        from kvsidecar.protocol.writer import close_for_writers

        if dead_only:
            # The manager SIGKILLs without reaping: is_alive() stays True until joined. A
            # killed process dies at once, so the wait is short; a live one is left alone.
            deadline = time.monotonic() + 5.0
            for p in processes:
                p.join(max(0.0, deadline - time.monotonic()))
        pids = {p.pid for p in processes if p.pid is not None}
        if dead_only:
            pids = {p.pid for p in processes if p.pid in pids and not p.is_alive()}
        shm_dir = settings.SHM_DIR.get(os.environ) or settings.SHM_DIR.default
        closed = close_for_writers(shm_dir, pids, dead_only=dead_only) if pids else []
        if closed:
            log.info(
                "kvsidecar: vLLM is stopping its engine core; closed its segment(s) %s",
                ", ".join(closed),
            )
    except Exception as e:
        _log_once("stopped", "kvsidecar could not close a stopped engine's segment: %s", e)


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent; never raises."""
    try:
        if _disabled():
            return
        try:
            from vllm.config.scheduler import SchedulerConfig
        except Exception:  # vLLM absent (or not this layout): nothing to do
            return
        _log_through_vllm()  # only inside vLLM: elsewhere kvsidecar's logging is untouched
        _patch_process_manager()
        original = getattr(SchedulerConfig, "get_scheduler_cls", None)
        if original is None:
            _log_once(
                "hook",
                "kvsidecar disabled for vLLM %s: SchedulerConfig.get_scheduler_cls is missing "
                "(tested: %s)",
                vllm_version(),
                ", ".join(TESTED_VERSIONS),
            )
            return
        if getattr(original, _PATCH_MARK, False):
            return

        def get_scheduler_cls(self: Any) -> type:
            cls = original(self)
            if _disabled():  # checked per engine: KVSIDECAR_DISABLE=1 gives vLLM's own class
                return cls
            try:
                return sidecar_scheduler_class(cls)
            except Exception as e:
                _log_once("subclass", "kvsidecar disabled (engine unaffected): %s", e)
                return cls

        setattr(get_scheduler_cls, _PATCH_MARK, True)
        get_scheduler_cls.__wrapped__ = original  # type: ignore[attr-defined]
        SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
    except Exception as e:
        _log_once("register", "kvsidecar vLLM plugin not registered (engine unaffected): %s", e)


def _missing(obj: Any, names: Iterable[str]) -> str | None:
    for name in names:
        if not hasattr(obj, name):
            return f"{type(obj).__name__ if not isinstance(obj, type) else obj.__name__}.{name}"
    return None


def _params(fn: Any) -> tuple[str, ...] | None:
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names[1:] if names[:1] == ("self",) else names


def _defined_params(cls: type, name: str) -> tuple[str, ...] | None:
    # A subclass's (*args, **kwargs) override (a custom --scheduler-cls) passes through:
    # the method it forwards to is the one whose signature counts.
    fn = getattr(cls, name, None)
    for klass in cls.__mro__:
        if name in vars(klass):
            fn = vars(klass)[name]
            params = inspect.signature(fn).parameters if callable(fn) else {}
            kinds = {p.kind for n, p in params.items() if n != "self"}
            if kinds != {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
                break
    return _params(fn)


def signature_mismatch(cls: type, table: str) -> str | None:
    """The first wrapped method of `cls` whose parameters differ from the tested ones, as
    ``Owner.method(found) instead of (expected)``; None when all match."""
    for name, want in HOOK_SIGNATURES[table].items():
        found = _defined_params(cls, name)
        if found != want:
            got = "?" if found is None else ", ".join(found)
            return f"{table}.{name}({got}) instead of ({', '.join(want)})"
    return None


def _hook_problem(version: str, missing: str | None, changed: str | None) -> bool:
    """Log the one line that disables the plugin; True when there is a problem."""
    if missing is not None:
        what = f"hook point {missing} is missing"
    elif changed is not None:
        what = f"hook point signature changed: {changed}"
    else:
        return False
    _log_once(
        "hook",
        "kvsidecar disabled for vLLM %s: %s (tested: %s)",
        version,
        what,
        ", ".join(TESTED_VERSIONS),
    )
    return True


def sidecar_scheduler_class(base: type) -> type:
    """A subclass of vLLM's chosen scheduler class that publishes every step (cached)."""
    if getattr(base, "_kvsidecar_scheduler", False):
        return base
    cached = _subclasses.get(base)
    if cached is not None:
        return cached
    missing = _missing(base, SCHEDULER_HOOKS)
    changed = signature_mismatch(base, "Scheduler") if missing is None else None
    if _hook_problem(vllm_version(), missing, changed):
        return base

    class KVSidecarScheduler(base):  # type: ignore[valid-type, misc]
        _kvsidecar_scheduler = True
        # A class default: vLLM's __init__ may call an overridden method before ours runs.
        _kvsidecar: VllmSidecar | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if _disabled():
                return
            try:
                self._kvsidecar = VllmSidecar.attach(self)
            except Exception as e:
                _log_once("attach", "kvsidecar disabled (engine unaffected): %s", e)

        def update_from_output(
            self, scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any
        ) -> Any:
            s = self._kvsidecar
            if s is not None and s.tracks_expiry:
                s.note_connector_output(model_runner_output)
            out = super().update_from_output(scheduler_output, model_runner_output, *args, **kwargs)
            if s is not None:
                s.publish(self)
            return out

        def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            out = super()._free_request(request, *args, **kwargs)
            s = self._kvsidecar
            if s is not None:
                s.after_free_request(self, request)
            return out

        def _free_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            s = self._kvsidecar
            if s is not None:
                s.before_free_blocks(request)
            return super()._free_blocks(request, *args, **kwargs)

        def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
            out = super().finish_requests(*args, **kwargs)
            s = self._kvsidecar
            if s is not None:  # aborts between steps: an idle engine would not publish them
                s.publish(self, engine_step=False)
            return out

        def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
            out = super().reset_prefix_cache(*args, **kwargs)
            s = self._kvsidecar
            if s is not None:
                s.publish(self, engine_step=False)
            return out

        def _preempt_request(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._preempt_request(*args, **kwargs)
            s = self._kvsidecar
            if s is not None:
                s.preempted()
            return out

        def shutdown(self) -> None:
            s = self._kvsidecar
            self._kvsidecar = None
            try:
                super().shutdown()
            finally:
                if s is not None:
                    s.close()

    KVSidecarScheduler.__name__ = KVSidecarScheduler.__qualname__ = f"KVSidecar{base.__name__}"
    KVSidecarScheduler.__module__ = __name__
    _subclasses[base] = KVSidecarScheduler
    return KVSidecarScheduler


# ------------------------------------------------------------------ identity


def _served_model_name(model_config: Any) -> str:
    # vLLM's model_name label: served_model_name (a list's first entry), else the model.
    name = getattr(model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or getattr(model_config, "model", "") or "")


def _dp_rank(par: Any) -> int:
    # data_parallel_index is the engine's DP rank for MoE and dense models alike;
    # data_parallel_rank is reset to 0 for dense DP ranks (older vLLM: only the latter).
    index = getattr(par, "data_parallel_index", None)
    if index is None:
        index = getattr(par, "data_parallel_rank", 0)
    return int(index or 0)


def identity(vllm_config: Any) -> dict[str, Any]:
    """KVSidecarAgent keyword arguments from a VllmConfig (the engine core's rank)."""
    par = vllm_config.parallel_config
    kv = getattr(vllm_config, "kv_transfer_config", None)
    kv_role = getattr(kv, "kv_role", None) if kv is not None else None
    kv_connector = getattr(kv, "kv_connector", None) if kv is not None else None
    role = ROLE_BY_KV_ROLE.get(kv_role, "both") if kv_connector else "both"
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return {
        "engine": "vllm",
        "engine_version": vllm_version(),
        "model_name": _served_model_name(vllm_config.model_config),
        "role": role,
        "dp_rank": _dp_rank(par),
        # Dense (non-MoE) DP ranks are reconfigured by vLLM as independent DP=1 engines,
        # so their size reads 1; the rank survives in data_parallel_index.
        "dp_size": max(int(getattr(par, "data_parallel_size", 1) or 1), _dp_rank(par) + 1),
        # One scheduler serves the whole DP rank: it speaks for TP/PP rank 0.
        "tp_rank": 0,
        "tp_size": int(getattr(par, "tensor_parallel_size", 1) or 1),
        "pp_rank": 0,
        "pp_size": int(getattr(par, "pipeline_parallel_size", 1) or 1),
        "device": str(device) if device else None,
    }


# ------------------------------------------------------------------ the sidecar


class VllmSidecar:
    """The agent and pool sources of one vLLM scheduler (one engine core, one DP rank)."""

    def __init__(
        self, agent: Any, sources: list[VllmPoolSource], tracks_expiry: bool = False
    ) -> None:
        self.agent = agent
        self.sources = sources
        # request id -> (deferral start ns, per-source block ids it held when it began)
        self._deferred: dict[str, tuple[int, list[list[int] | None]]] = {}
        # The connector reports lease expiries (NixlConnector's num_kv_expired_reqs): tell
        # this step's expiry releases from completed transfers.
        self.tracks_expiry = tracks_expiry
        self._expired_now: set[str] = set()

    @classmethod
    def attach(cls, scheduler: Any) -> VllmSidecar | None:
        version = vllm_version()
        manager = getattr(scheduler, "kv_cache_manager", None)
        missing = (
            "Scheduler.kv_cache_manager" if manager is None else _missing(manager, MANAGER_HOOKS)
        )
        if missing is None:
            missing = _missing(manager.block_pool, BLOCK_POOL_HOOKS)
        if missing is None and not hasattr(manager.coordinator, "single_type_managers"):
            missing = "KVCacheCoordinator.single_type_managers"
        changed = None
        if missing is None:
            changed = signature_mismatch(type(manager.block_pool), "BlockPool")
            changed = changed or signature_mismatch(type(manager), "KVCacheManager")
        if _hook_problem(version, missing, changed):
            return None
        if version not in TESTED_VERSIONS:
            log.info("kvsidecar: vLLM %s is untested (tested: %s)", version, TESTED_VERSIONS)

        from kvsidecar.agent.agent import KVSidecarAgent

        ident = identity(scheduler.vllm_config)
        # Heartbeat: an idle vLLM engine does not step; keep its last snapshot fresh.
        agent = KVSidecarAgent(**ident, heartbeat_interval=1.0)
        if not agent.enabled:
            return None
        try:
            sources = VllmPoolSource.for_manager(manager, scheduler.kv_cache_config)
            for src in sources:
                agent.register_pool(src)
        except Exception:
            agent.close()  # no half-set-up segment left behind
            raise
        tracks_expiry = reports_expiry(getattr(scheduler, "connector", None))
        for src in sources:
            src.start_deferral_counters(tracks_expiry)
        sidecar = cls(agent, sources, tracks_expiry)
        if hasattr(scheduler, "_preempt_request"):  # counted by the subclass's wrapper
            agent.runtime.preemptions_total = 0
        sidecar.publish(scheduler, engine_step=False)  # visible before the first step
        log.info(
            "kvsidecar: publishing vLLM %s engine core (dp_rank %d) to %s",
            version,
            ident["dp_rank"],
            agent.segment_path,
        )
        return sidecar

    # -- scheduler hooks (never raise) -------------------------------------------------

    def after_free_request(self, scheduler: Any, request: Any) -> None:
        try:
            rid = request.request_id
            # Still in Scheduler.requests after _free_request: a connector deferred it.
            if scheduler.requests.get(rid) is not request or rid in self._deferred:
                return
            now = time.monotonic_ns()
            held: list[list[int] | None] = []
            for src in self.sources:
                held.append(src.defer(rid, now))
            # A deferral counts only while it holds a block (schema.md): one holding none
            # is neither in the runtime count nor a candidate for this step's expiries
            # (NixlConnector defers only requests with blocks, so its count is theirs).
            if any(ids is not None for ids in held):
                self._deferred[rid] = (now, held)
        except Exception as e:
            _log_once("defer", "kvsidecar deferral tracking failed (engine unaffected): %s", e)

    def note_connector_output(self, model_runner_output: Any) -> None:
        """Before vLLM frees this step's ``finished_sending``: which of them the worker
        released at lease expiry. The worker reports only a count per step
        (``kv_connector_stats.data["num_kv_expired_reqs"]``, one entry per expiry) beside
        the ids; when a step mixes both kinds, the oldest deferrals are taken as the
        expired ones (the counts stay exact; only the blocks split is attributed)."""
        self._expired_now.clear()
        try:
            out = getattr(model_runner_output, "kv_connector_output", None)
            sending = getattr(out, "finished_sending", None) if out is not None else None
            if not sending:
                return
            data = getattr(getattr(out, "kv_connector_stats", None), "data", None)
            n = len(data.get("num_kv_expired_reqs") or ()) if isinstance(data, dict) else 0
            if n <= 0:
                return
            deferred = self._deferred
            ours = [rid for rid in sending if rid in deferred]
            if n < len(ours):
                ours.sort(key=lambda rid: deferred[rid][0])
                del ours[n:]
            self._expired_now.update(ours)
        except Exception as e:
            _log_once("expiry", "kvsidecar expiry tracking failed (engine unaffected): %s", e)

    def before_free_blocks(self, request: Any) -> None:
        try:
            rid = request.request_id
            entry = self._deferred.pop(rid, None)
            if entry is None:
                return
            expired = rid in self._expired_now
            for src, ids in zip(self.sources, entry[1]):
                if ids is not None:
                    src.release(rid, ids, expired)
        except Exception as e:
            _log_once("release", "kvsidecar deferral tracking failed (engine unaffected): %s", e)

    def preempted(self) -> None:
        runtime = self.agent.runtime
        runtime.preemptions_total = (runtime.preemptions_total or 0) + 1

    def publish(self, scheduler: Any, engine_step: bool = True) -> None:
        try:
            agent = self.agent
            if not engine_step:
                # Not an engine step: republish without advancing the step counter.
                agent.runtime.step -= 1
            running, waiting = scheduler.get_request_counts()
            agent.step(running, waiting, len(self._deferred))
        except Exception as e:
            _log_once("publish", "kvsidecar publish failed (engine unaffected): %s", e)

    def close(self) -> None:
        try:
            self.agent.close()
        except Exception as e:
            _log_once("close", "kvsidecar close failed: %s", e)


def reports_expiry(connector: Any) -> bool:
    """Whether the connector's transfer stats count lease expiries (NixlConnector's
    ``num_kv_expired_reqs``), read from the stats class the connector itself builds."""
    try:
        build = getattr(type(connector), "build_kv_connector_stats", None)
        stats = build() if connector is not None and build is not None else None
        data = getattr(stats, "data", None)
        return isinstance(data, dict) and "num_kv_expired_reqs" in data
    except Exception:
        return False


# ------------------------------------------------------------------ pools


def _kv_buffers(spec: Any) -> int:
    # MLA keeps one latent buffer per layer; every other attention spec keeps K and V.
    return 1 if "MLA" in type(spec).__name__ else 2


class VllmPoolSource:
    """`PoolSource` over one vLLM ``BlockPool``, counters kept at mutation time.

    Definitions (checked against a brute-force recount over ``BlockPool.blocks`` and
    ``Scheduler.requests`` after every step by tests/engines/test_vllm_accounting.py):

    * total = ``num_gpu_blocks - 1`` (the null block is never handed out); virtual_blocks
      = ``num_gpu_blocks`` (the storage, null block included, as for every source);
      available = ``free_block_queue.num_free_blocks`` (free + evictable cached);
      allocated = total - available (= non-null blocks with ``ref_cnt > 0``), so
      allocated/total is ``vllm:kv_cache_usage_perc``.
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
        spec = specs[0] if specs else None
        buffers = _kv_buffers(spec) if spec is not None else 2
        page = int(getattr(spec, "page_size_bytes", 0) or 0) if spec is not None else 0
        block_bytes = page // buffers if buffers else page
        total = int(pool.num_gpu_blocks) - 1
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
        """One source per distinct BlockPool (vLLM's KV-cache groups share one pool)."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
        by_pool: dict[int, tuple[Any, list[int], list[Any]]] = {}
        for m in manager.coordinator.single_type_managers:
            pool = m.block_pool
            entry = by_pool.setdefault(id(pool), (pool, [], []))
            entry[1].append(int(getattr(m, "kv_cache_group_id", len(entry[1]))))
            entry[2].append(m)
        if id(manager.block_pool) not in by_pool:
            by_pool[id(manager.block_pool)] = (manager.block_pool, [0], [])
        tensors = list(getattr(kv_cache_config, "kv_cache_tensors", []) or [])
        sources = []
        for i, (pool, group_ids, managers) in enumerate(by_pool.values()):
            specs = [groups[g].kv_cache_spec for g in group_ids if g < len(groups)]
            layers = sum(len(groups[g].layer_names) for g in group_ids if g < len(groups))
            main = pool is manager.block_pool
            mapped = (
                sum(int(t.size) for t in tensors if not getattr(t, "host_resident", False))
                if main
                else 0
            )
            sources.append(
                cls(
                    pool,
                    group_id=min(group_ids),
                    pool_name="block_pool" if i == 0 else f"block_pool_{i}",
                    specs=specs,
                    num_layers=layers,
                    mapped_bytes=mapped,
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
