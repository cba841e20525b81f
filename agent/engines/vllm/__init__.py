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
No exception from this package ever reaches the engine.

The package: this module, the entry point and the process manager's shutdown; `hooks` (hook
points, signatures, the disabling line, the ``vllm.kvsidecar`` logger); `scheduler` (the
scheduler subclass, `VllmSidecar`, the engine core's identity); `accounting`
(`VllmPoolSource`). Every name other code imports is importable from here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvsidecar.agent.engines._patching import close_segments, disabled, is_patched, mark_patched
from kvsidecar.agent.engines.vllm.accounting import VllmPoolSource
from kvsidecar.agent.engines.vllm.hooks import (
    BLOCK_POOL_HOOKS,
    HOOK_SIGNATURES,
    MANAGER_HOOKS,
    SCHEDULER_HOOKS,
    TESTED_VERSIONS,
    _log_once,
    log,
    signature_mismatch,
    vllm_version,
)
from kvsidecar.agent.engines.vllm.hooks import _logged as _logged  # tests forget a key
from kvsidecar.agent.engines.vllm.scheduler import (
    ROLE_BY_KV_ROLE,
    VllmSidecar,
    identity,
    reports_expiry,
    sidecar_scheduler_class,
)

__all__ = [
    "BLOCK_POOL_HOOKS",
    "HOOK_SIGNATURES",
    "MANAGER_HOOKS",
    "ROLE_BY_KV_ROLE",
    "SCHEDULER_HOOKS",
    "TESTED_VERSIONS",
    "VllmPoolSource",
    "VllmSidecar",
    "identity",
    "log",
    "register",
    "reports_expiry",
    "sidecar_scheduler_class",
    "signature_mismatch",
    "vllm_version",
]


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
    if original is None or is_patched(original):
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

    mark_patched(shutdown, original)
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
        if dead_only:
            # The manager SIGKILLs without reaping: is_alive() stays True until joined. A
            # killed process dies at once, so the wait is short; a live one is left alone.
            deadline = time.monotonic() + 5.0
            for p in processes:
                p.join(max(0.0, deadline - time.monotonic()))
        pids = {p.pid for p in processes if p.pid is not None}
        if dead_only:
            pids = {p.pid for p in processes if p.pid in pids and not p.is_alive()}
        closed = close_segments(pids, dead_only)
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
        if disabled():
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
        if is_patched(original):
            return

        def get_scheduler_cls(self: Any) -> type:
            cls = original(self)
            if disabled():  # checked per engine: KVSIDECAR_DISABLE=1 gives vLLM's own class
                return cls
            try:
                return sidecar_scheduler_class(cls)
            except Exception as e:
                _log_once("subclass", "kvsidecar disabled (engine unaffected): %s", e)
                return cls

        mark_patched(get_scheduler_cls, original)
        SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
    except Exception as e:
        _log_once("register", "kvsidecar vLLM plugin not registered (engine unaffected): %s", e)
