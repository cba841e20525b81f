"""How a vLLM engine core's fault reaches its segment: FAULTED, never "closed cleanly".

Two ways an engine core ends without a normal shutdown while its process is still alive:

* **A fatal error** (a worker raised, a worker process died, the busy loop raised): vLLM
  logs "EngineCore encountered a fatal error" and calls ``EngineCoreProc._send_engine_dead``
  before its own teardown; its API server then raises ``EngineDeadError`` and runs the same
  ``timeout=0`` shutdown as a routine SIGTERM. The wrapper below marks this process's
  segments FAULTED first, so the message that starts that shutdown is sent only after the
  mark is in shared memory, and the process manager's close (``__init__``) leaves them.
* **An orphan**: the API server was SIGKILLed (or OOM-killed). vLLM's engine core does not
  notice: it idles for ever, reparented to init, heartbeating, read "up" by every reader
  (measured on vLLM 0.32.0: still up 25 s and minutes later). Nothing can reach it any
  more, so a thread blocked on a pidfd of the parent marks the segments FAULTED when the
  parent exits. In a routine stop the parent closes the segment (CLOSED) before it exits,
  and FAULTED never overwrites CLOSED (`SegmentWriter.mark_faulted`).

Installed from the engine core only (`VllmSidecar.attach`), where ``vllm.v1.engine.core``
is already imported; never raises.
"""

from __future__ import annotations

import os
import select
import sys
import threading
from typing import Any

from kvsidecar.agent import faults
from kvsidecar.agent.engines._patching import is_patched, mark_patched
from kvsidecar.agent.engines.vllm.hooks import _log_once

ENGINE_CORE_MODULE = "vllm.v1.engine.core"
_watching = False


def install() -> None:
    """Wrap ``EngineCoreProc._send_engine_dead`` and watch the parent process (once)."""
    try:
        _patch_send_engine_dead()
    except Exception as e:
        _log_once("faults", "kvsidecar: engine faults not tracked (engine unaffected): %r", e)
    try:
        _watch_parent()
    except Exception as e:
        _log_once("orphan", "kvsidecar: parent not watched (engine unaffected): %r", e)


def _patch_send_engine_dead() -> None:
    core = sys.modules.get(ENGINE_CORE_MODULE)
    cls = getattr(core, "EngineCoreProc", None)
    original = getattr(cls, "_send_engine_dead", None)
    if original is None:
        _log_once(
            "faults",
            "kvsidecar: EngineCoreProc._send_engine_dead not found: a fatal engine error "
            "reads as the engine's stop, not as a fault",
        )
        return
    if is_patched(original):
        return

    def _send_engine_dead(self: Any, *args: Any, **kwargs: Any) -> Any:
        faults.fault_all("vLLM's engine core encountered a fatal error")
        return original(self, *args, **kwargs)

    mark_patched(_send_engine_dead, original)
    cls._send_engine_dead = _send_engine_dead  # type: ignore[union-attr]


def _watch_parent() -> None:
    global _watching
    if _watching:
        return
    parent = os.getppid()
    if parent <= 1:
        return  # started by init itself: there is no launcher to outlive
    fd = os.pidfd_open(parent)
    if os.getppid() != parent:  # died before the pidfd named it
        os.close(fd)
        faults.fault_all(f"vLLM's API server (pid {parent}) exited before its engine core")
        return
    _watching = True
    threading.Thread(
        target=_wait_for_exit, args=(fd, parent), name="kvsidecar-parent", daemon=True
    ).start()


def _wait_for_exit(fd: int, parent: int) -> None:
    """Blocks (no CPU, no wake-ups) until the parent exits."""
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)
    faults.fault_all(
        f"vLLM's API server (pid {parent}) exited while its engine core ran: an orphaned "
        "engine core that nothing can reach"
    )
