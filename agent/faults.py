"""A fault never reads as a clean stop: marking this process's segments FAULTED.

"Closed cleanly" (state CLOSED) is for an engine that completed a normal shutdown; it
cannot be decided from outside the engine. An engine that hit a fatal error is still
alive when its stop begins (vLLM's engine core reports the error, then its API server
runs the same shutdown as a routine SIGTERM), so "was it alive when stopped" reads a
fault as a stop. So the engine's own fatal-error path marks its segments FAULTED
(segment-format.md, section 6): readers read them dead at once, `close()` keeps them so,
and a supervisor's `close_for_writers` leaves them alone.

Who calls `fault_all`: an engine integration from the engine's fatal-error path (vLLM:
``EngineCoreProc._send_engine_dead``; SGLang: the scheduler's exception handler), and the
``sys.excepthook`` installed here, because an uncaught exception ends a plain Python
engine through ``atexit``, where the agent's own ``close()`` would otherwise say CLOSED.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from types import TracebackType
from typing import Protocol

log = logging.getLogger(__name__)


class _Faultable(Protocol):
    def fault(self, reason: str) -> bool: ...


_live: weakref.WeakSet[_Faultable] = weakref.WeakSet()
_lock = threading.Lock()
_hook_installed = False


def track(agent: _Faultable) -> None:
    """Remember a publishing agent of this process, for `fault_all`; the first one also
    installs the uncaught-exception hook."""
    with _lock:
        _live.add(agent)
    _install_excepthook()


def fault_all(reason: str) -> int:
    """Mark every publishing agent of this process FAULTED; how many were. Never raises."""
    try:
        with _lock:
            agents = list(_live)
        return sum(1 for a in agents if a.fault(reason))
    except Exception as e:  # never into the engine's own error path
        log.warning("kvsidecar could not mark its segments faulted: %r", e)
        return 0


def _install_excepthook() -> None:
    global _hook_installed
    with _lock:
        if _hook_installed:
            return
        _hook_installed = True
        previous = sys.excepthook

    def excepthook(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        # Runs before atexit: the segments then stay FAULTED through the agents' close().
        if not issubclass(kind, KeyboardInterrupt):  # Ctrl-C is a routine stop
            fault_all(f"uncaught {kind.__name__}: {value}")
        previous(kind, value, tb)

    sys.excepthook = excepthook
