"""The scheduler subclass and the sidecar it owns: one `KVSidecarAgent` per engine core.

`sidecar_scheduler_class` subclasses whatever scheduler class vLLM chose (cached per class).
The subclass owns one `VllmSidecar` per engine core (= per DP rank), which publishes after
every ``update_from_output`` (once per engine step, empty steps included) plus after the
between-step mutations (``finish_requests`` for aborts, ``reset_prefix_cache``), so the
segment matches the engine at quiescent moments too, and tracks the requests a connector
keeps after they finished (their blocks are counted by the pools' `VllmPoolSource`).
"""

from __future__ import annotations

import time
from typing import Any

from kvsidecar.agent.engines._patching import disabled
from kvsidecar.agent.engines.vllm import faults
from kvsidecar.agent.engines.vllm.accounting import VllmPoolSource
from kvsidecar.agent.engines.vllm.hooks import (
    BLOCK_POOL_HOOKS,
    MANAGER_HOOKS,
    SCHEDULER_HOOKS,
    TESTED_VERSIONS,
    _hook_problem,
    _log_once,
    _missing,
    log,
    signature_mismatch,
    vllm_version,
)

ROLE_BY_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_subclasses: dict[type, type] = {}


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
            if disabled():
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
    # The package, where the plugin is imported from (this class was defined there before
    # the plugin was split into modules).
    KVSidecarScheduler.__module__ = "kvsidecar.agent.engines.vllm"
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
        faults.install()  # a fault or an orphaned core reads dead, never closed cleanly
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
