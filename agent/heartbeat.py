"""The agent's idle heartbeat: a daemon thread that refreshes the segment while no step runs.

The thread holds the segment writer, a stop event and the time of the last step, and
nothing else: never the agent, so never the engine's pools. A daemon thread that holds the
last reference to a torch tensor may free it while the interpreter finalizes; torch's
deallocator releases the GIL, the thread cannot take it back, CPython ends the thread with
``pthread_exit``, and the unwind through torch's ``noexcept`` C++ frame calls
``std::terminate``: the engine dies with SIGABRT ("terminate called without an active
exception") after a clean stop. ``stop()`` also joins the thread, so none is left to race
finalization at all.
"""

from __future__ import annotations

import logging
import threading
import time

from kvsidecar.protocol.writer import SegmentWriter

log = logging.getLogger(__name__)

# How long stop() waits for the thread: it wakes at once from its event, so this is a bound
# on a heartbeat write in progress (microseconds), not a delay anyone normally sees.
_JOIN_TIMEOUT_S = 1.0


class IdleHeartbeat:
    """Refreshes ``writer``'s heartbeat once ``interval`` s have passed with no step (then
    every ``interval`` s while none comes), so the heartbeat is never older than about
    ``interval`` while the process runs.

    An idle engine stays fresh; so does a *hung* one (its step counter stops instead):
    pass interval 0 to the agent to detect hangs by age.
    """

    __slots__ = ("_interval_ns", "_stop", "_thread", "_writer", "last_step_ns")

    def __init__(self, writer: SegmentWriter, interval: float) -> None:
        self.last_step_ns = time.perf_counter_ns()  # the agent stores each step's start here
        self._interval_ns = interval * 1e9
        self._writer: SegmentWriter | None = writer
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="kvsidecar-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self, interval: float) -> None:
        # Wake when `interval` has passed since the last step, not on a fixed grid: on a grid
        # a step just after one wake left the segment without a heartbeat for almost two
        # intervals (1.99 s at 1 s), longer than a gateway's freshness bound (1.5 s).
        wait = interval
        while not self._stop.wait(wait):
            writer = self._writer
            if writer is None:
                return
            idle = time.perf_counter_ns() - self.last_step_ns
            if idle < self._interval_ns:
                wait = (self._interval_ns - idle) / 1e9
                continue
            wait = interval
            try:
                writer.heartbeat()
            except Exception as e:  # a closed or truncated segment: nothing left to keep
                log.warning("kvsidecar heartbeat stopped: %s", e)
                return

    def stop(self, join: bool = True) -> None:
        """Stop the thread; join it unless ``join`` is False (a step must not wait)."""
        self._stop.set()
        self._writer = None
        if join and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
