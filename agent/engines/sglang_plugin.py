"""The SGLang plugin: the kvsidecar agent inside every SGLang scheduler process.

Why SGLang's own plugin loader: SGLang (0.5.23) loads the ``sglang.srt.plugins`` entry points
in every scheduler process (``run_scheduler_process`` calls ``load_plugins()`` before it builds
the ``Scheduler``) and applies the hooks they register with its ``HookRegistry``. Installing
kvsidecar into SGLang's environment is therefore all a user does, as for vLLM; no file of
SGLang is changed, no wrapper command and no ``.pth`` line are needed. ``KVSIDECAR_DISABLE=1``
(or ``SGLANG_PLUGINS`` without ``kvsidecar``) leaves SGLang exactly as it was.

Hooks (all AFTER/AROUND SGLang's own method, which runs first and whose exceptions pass
through unchanged; what kvsidecar does is caught and logged once, never raised into SGLang):

* ``Scheduler.__init__``: attach an agent and the `SGLangPoolSource` of its pool;
* ``Scheduler.process_batch_result`` and ``Scheduler.on_idle``: one publish per scheduler
  iteration (a batch was processed, or there was none), the event loops' two branches; after
  a prefill batch, its prefix-cache counts (``batch.prefill_stats``) first;
* ``ScheduleBatch.retract_decode``: counts retracted requests (SGLang's preemptions);
* ``kill_process_tree`` in the launching process: SGLang stops its schedulers with SIGKILL
  (``Engine.shutdown``), so the segments of schedulers still alive when the stop begins are
  closed first; a scheduler already dead (killed, crashed) is left to read "dead".
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvsidecar.agent.engines._patching import LogOnce, close_segments, disabled

log = logging.getLogger("sglang.kvsidecar")
_log_once = LogOnce(log)

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
RETRACT = "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode"
KILL_TREE = "sglang.srt.utils.common.kill_process_tree"
TESTED_VERSIONS = ("0.5.23",)

_retracted = 0  # requests retracted in this process (one scheduler per process)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Never raises."""
    try:
        if disabled():
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception as e:  # not an SGLang with the hook registry: nothing to do
        _log_once(
            "import", "kvsidecar disabled for this SGLang (tested %s): %r", TESTED_VERSIONS, e
        )
        return
    try:
        HookRegistry.register(f"{SCHEDULER}.__init__", _after_init, HookType.AFTER)
        HookRegistry.register(f"{SCHEDULER}.process_batch_result", _after_batch, HookType.AFTER)
        HookRegistry.register(f"{SCHEDULER}.on_idle", _after_step, HookType.AFTER)
        HookRegistry.register(RETRACT, _after_retract, HookType.AFTER)
        HookRegistry.register(KILL_TREE, _around_kill_tree, HookType.AROUND)
    except Exception as e:
        _log_once("register", "kvsidecar hooks not registered (engine unaffected): %r", e)


def _after_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    if "_kvsidecar" in scheduler.__dict__:  # a subclass's __init__ ran ours already
        return
    scheduler.__dict__["_kvsidecar"] = None
    try:
        from kvsidecar.agent.engines.sglang import SGLangSidecar

        scheduler.__dict__["_kvsidecar"] = SGLangSidecar.attach(scheduler)
    except Exception as e:
        _log_once("attach", "kvsidecar not attached to this scheduler (engine unaffected): %r", e)


def _after_batch(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """``process_batch_result(batch, result)``: SGLang's hook wrapper does not catch what an
    AFTER hook raises, so everything that reads SGLang's objects here is guarded."""
    sidecar = scheduler.__dict__.get("_kvsidecar")
    if sidecar is not None:
        try:
            sidecar.count_prefill(args[0] if args else kwargs["batch"])
        except Exception as e:  # an SGLang whose PrefillStats moved: counters stop, rest goes on
            _log_once("prefill", "kvsidecar: prefix-cache counters not counted: %r", e)
        sidecar.publish(scheduler, _retracted)


def _after_step(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    sidecar = scheduler.__dict__.get("_kvsidecar")
    if sidecar is not None:
        sidecar.publish(scheduler, _retracted)


def _after_retract(result: Any, *args: Any, **kwargs: Any) -> None:
    global _retracted
    try:
        _retracted += len(result[0])  # (retracted_reqs, new_token_ratio, reqs_to_abort)
    except Exception as e:
        _log_once("retract", "kvsidecar: retractions not counted: %r", e)


def _around_kill_tree(original: Any, parent_pid: int, *args: Any, **kwargs: Any) -> Any:
    try:
        if parent_pid == os.getpid():  # the launcher stopping its own children
            _close_children(parent_pid)
    except Exception as e:
        _log_once("stop", "kvsidecar could not close a stopped scheduler's segment: %r", e)
    return original(parent_pid, *args, **kwargs)


def _close_children(parent_pid: int) -> None:
    import psutil

    pids = set()
    for child in psutil.Process(parent_pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:  # a dead scheduler must read dead
                pids.add(child.pid)
        except psutil.Error:
            continue
    closed = close_segments(pids, dead_only=False)
    if closed:
        log.info("kvsidecar: SGLang is stopping its schedulers; closed %s", ", ".join(closed))
