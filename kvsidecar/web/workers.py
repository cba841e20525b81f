"""Where requests run: a fixed pool of worker threads fed from the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Any

__all__ = ["Workers"]


class Workers:
    """A fixed set of threads, all started at once: the daemon's thread count (and its
    memory map) stays flat whatever the load, well inside the unit's TasksMax."""

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> asyncio.Future:
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome = (fn(*args), None)
            except Exception as e:
                outcome = (None, e)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, *outcome)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
