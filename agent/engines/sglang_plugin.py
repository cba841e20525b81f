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
* ``Scheduler.run_event_loop`` (AROUND): how a scheduler ends decides how its segment reads
  (segment-format.md section 6). The loop returns only after SGLang's ``ShutdownReq`` (its
  launcher's graceful stop): closed cleanly. An exception (SGLang then logs "Scheduler hit
  an exception" and SIGQUITs its launcher, which kills the tree): FAULTED first, so the
  launcher's clean-up below cannot call it a stop. Ctrl-C (KeyboardInterrupt): a stop.
* SIGTERM in a scheduler process, where SGLang leaves its default action (die): systemd's
  ``KillMode=control-group`` and ``kubectl delete`` send it to every process at once, and
  the scheduler died before its launcher could stop it, reading "dead". A SIGTERM is a
  request to stop, so the handler closes the segment, then dies of SIGTERM exactly as
  SGLang's own default would (no delay, same exit status).
* ``kill_process_tree`` in the launching process: SGLang stops its schedulers with SIGKILL
  (``Engine.shutdown``), so the segments of schedulers still alive when the stop begins are
  closed first; a scheduler already dead (killed, crashed) is left to read "dead", and one
  that faulted stays FAULTED (``close_for_writers`` leaves it). Only SGLang's graceful path
  (``include_parent=False``) closes: its fault paths (a child's SIGQUIT, a failed warm-up,
  a tokenizer-manager exception) kill the tree with the launcher itself, and those stops
  read dead.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from kvsidecar.agent import faults
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
        HookRegistry.register(f"{SCHEDULER}.run_event_loop", _around_loop, HookType.AROUND)
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

        sidecar = SGLangSidecar.attach(scheduler)
        scheduler.__dict__["_kvsidecar"] = sidecar
    except Exception as e:
        _log_once("attach", "kvsidecar not attached to this scheduler (engine unaffected): %r", e)
        return
    if sidecar is not None:
        _close_on_sigterm(sidecar)


def _close_on_sigterm(sidecar: Any) -> None:
    """Where SGLang leaves SIGTERM at its default (die): close, then die of it as before."""
    try:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers are the main thread's to set
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the engine handles SIGTERM itself: its stop path closes

        def on_sigterm(signum: int, frame: Any) -> None:
            try:
                sidecar.agent.close()  # CLOSED, unlinked: a stop was asked for
            finally:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)  # SGLang's own default: die of it

        signal.signal(signal.SIGTERM, on_sigterm)
    except Exception as e:
        _log_once("sigterm", "kvsidecar: SIGTERM not hooked (engine unaffected): %r", e)


def _around_loop(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """The scheduler's whole life after start-up: its end says clean stop or fault."""
    try:
        result = original(scheduler, *args, **kwargs)
    except Exception as e:
        faults.fault_all(f"SGLang's scheduler hit an exception: {type(e).__name__}: {e}")
        raise
    except KeyboardInterrupt:
        _close(scheduler)  # Ctrl-C: a stop
        raise
    _close(scheduler)  # the loop ended on SGLang's ShutdownReq: a normal shutdown
    return result


def _close(scheduler: Any) -> None:
    sidecar = scheduler.__dict__.get("_kvsidecar")
    if sidecar is not None:
        sidecar.agent.close()  # never raises


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
        # The launcher stopping its own children on its graceful path; with itself
        # (include_parent, the default) it is one of SGLang's fault paths.
        include_parent = kwargs.get("include_parent", args[0] if args else True)
        if parent_pid == os.getpid() and include_parent is False:
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
