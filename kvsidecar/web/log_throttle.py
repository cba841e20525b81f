"""Log lines that a flood cannot multiply."""

from __future__ import annotations

import logging
import time

__all__ = ["Throttled"]


class Throttled:
    """One log line per ``interval_s`` at most, saying how many were held back: a flood
    of bad requests must not become a flood of log lines."""

    def __init__(self, log: logging.Logger, level: int, interval_s: float = 1.0) -> None:
        self.log, self.level, self.interval_s = log, level, interval_s  # the caller's logger
        self._next = 0.0
        self._held = 0

    def __call__(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            msg += f" ({self._held} similar not logged)"
        self._next, self._held = now + self.interval_s, 0
        self.log.log(self.level, msg, *args)
