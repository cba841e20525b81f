"""A stop flag set from signal handlers (shared by the daemon, the demo and its engines)."""

from __future__ import annotations

import time


class StopFlag:
    """Set from a signal handler. Not a threading.Event: Event.set() takes a lock, and a
    second signal (Ctrl-C twice, or a process-group SIGTERM plus a forwarded one) can run
    its handler inside the first one's set() and deadlock on that lock."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` (keep it short: a signal does not cut it short)."""
        if not self._set and timeout > 0:
            time.sleep(timeout)
        return self._set
