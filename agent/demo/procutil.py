"""Process plumbing for the demo engines (no torch here): stop signals, parent-death signal,
a JSONL record of finished requests and a periodic status line."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, TextIO

from kvsidecar.stopflag import StopFlag
from kvsidecar.supervise import parent_death_signal


def install_stop_handlers() -> StopFlag:
    """SIGINT/SIGTERM set the returned flag instead of killing the process, so the engine
    loop ends and closes its agent (which unlinks the segment)."""
    stop = StopFlag()

    def handler(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def set_pdeathsig(parent: int, sig: int = signal.SIGTERM) -> None:
    """Linux: get `sig` when the parent dies, so a SIGKILLed launcher leaves no orphans."""
    parent_death_signal(sig)(parent)


def log(role: str, message: str) -> None:
    """One line on stderr in one write(2), so the two engines' lines never glue together
    (``print(..., flush=True)`` writes the text and the newline separately when stderr is
    unbuffered, as under PYTHONUNBUFFERED=1)."""
    data = f"kvsidecar-demo[{role}] {message}\n".encode(errors="backslashreplace")
    sys.stderr.flush()  # whatever Python buffered for stderr goes first
    while data:
        try:
            data = data[os.write(sys.stderr.fileno(), data) :]
        except (OSError, ValueError):
            return  # stderr closed: the demo runs on without its log


class Recorder:
    """Appends one JSON line per event to a file shared by the P/D pair (O_APPEND: a line
    is one write, so the two processes' lines do not interleave)."""

    def __init__(self, path: str | None, role: str) -> None:
        self.role = role
        self._f: TextIO | None = open(path, "a", buffering=1) if path else None

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def write(self, **fields: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"role": self.role, **fields}) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class Ticker:
    """Calls `emit(elapsed_s, steps_per_s)` every `interval` seconds (0 = never)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.t0 = self._last = time.monotonic()
        self._steps = 0

    def due(self, steps: int) -> tuple[float, float] | None:
        if not self.interval:
            return None
        now = time.monotonic()
        if now - self._last < self.interval:
            return None
        rate = (steps - self._steps) / (now - self._last)
        self._last, self._steps = now, steps
        return now - self.t0, rate
