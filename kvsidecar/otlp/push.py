"""The push thread: off the serving path, memory bounded, never blocking a scrape.

A ticker thread builds one batch per interval from the collector's families and offers it
to a bounded queue; a sender thread exports. A slow or dead collector only fills the
queue: the oldest batch is dropped (counted), so memory stays at maxsize batches and the
ticker never waits on the network. Each export has a deadline (transport.py), so a
collector that never finishes its answer fails that export, logged, instead of holding
the sender thread for ever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from kvsidecar.otlp.convert import Batch, Delta, Encoder
from kvsidecar.otlp.errors import explain

log = logging.getLogger(__name__)


class BatchSender(Protocol):
    endpoint: str

    def send(self, body: bytes) -> str: ...  # "" when accepted, else why not

    def close(self) -> None: ...


class Pusher:
    def __init__(
        self,
        families: Callable[[], Iterable],
        sender: BatchSender,
        interval_s: float,
        delta: bool = False,
        maxsize: int = 4,
        instances: Callable[[], Mapping[str, str]] | None = None,
        encoder: Encoder | None = None,
        describe: str = "",
    ) -> None:
        self._families, self._sender, self._interval = families, sender, interval_s
        self._instances = instances  # segment -> runtime.instance, for the Resource
        self._endpoint = sender.endpoint
        self._describe = describe  # how it is configured, for the start line
        self.failing = ""  # the one-line cause while exports fail, "" while they succeed
        self._encoder = encoder if encoder is not None else Encoder()
        if delta:
            self._encoder.delta = Delta()
        self._delta = self._encoder.delta is not None
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._stop = threading.Event()
        self._start_ns = time.time_ns()
        self.stats = {"exported": 0, "failed": 0, "dropped": 0}
        self._threads = [
            threading.Thread(target=self._tick, name="otlp-ticker", daemon=True),
            threading.Thread(target=self._send, name="otlp-sender", daemon=True),
        ]

    def start(self) -> None:
        log.info(
            "OTLP push to %s every %g s%s",
            self._endpoint,
            self._interval,
            f" ({self._describe})" if self._describe else "",
        )
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self._sender.close()

    def dropped(self) -> dict[str, int]:
        """Batches lost, by reason: the kvsidecar_otlp_dropped_batches_total series."""
        return {"queue_full": self.stats["dropped"], "send_failed": self.stats["failed"]}

    def build(self) -> Batch:
        """One batch of the current values (the ticker's work)."""
        now = time.time_ns()
        # Two reads of the views: a segment's instance changes only when its writer
        # restarts, so at worst one push names the previous instance.
        instances = self._instances() if self._instances is not None else None
        batch = self._encoder.encode(self._families(), now, self._start_ns, instances)
        if self._delta:
            self._start_ns = now
        return batch

    def tick_once(self) -> None:
        """Build one batch and offer it (the ticker's body; tests call it directly)."""
        data = self.build()
        while True:
            try:
                self._queue.put_nowait(data)
                return
            except queue.Full:
                try:  # drop the oldest: the newest holds the freshest values
                    self._queue.get_nowait()
                    self.stats["dropped"] += 1
                except queue.Empty:
                    pass

    def _tick(self) -> None:
        # The first batch at once, not an interval after start: a collector sees a new
        # sidecar (and a bad endpoint is logged) without waiting, e.g., 60 s.
        while True:
            try:
                self.tick_once()
            except Exception as e:  # a conversion bug skips one batch, never the push
                log.error("OTLP push: building a batch failed: %s: %s", type(e).__name__, e)
            if self._stop.wait(self._interval):
                return

    def _send(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            self.send_one(data)

    def send_one(self, batch: Batch) -> bool:
        """Export one batch, count it, and log the first success and each change between
        failing and working."""
        try:
            why = self._sender.send(batch.body)
        except Exception as e:  # a transport bug must not end the thread
            why = f"{type(e).__name__}: {e}"
        ok = not why
        self.stats["exported" if ok else "failed"] += 1
        if ok and self.stats["exported"] == 1:
            log.info(
                "OTLP push to %s: first batch accepted (%d resources, %d points, %d bytes)",
                self._endpoint,
                batch.resources,
                batch.points,
                len(batch.body),
            )
        if ok and self.failing:
            log.info("OTLP push to %s works again", self._endpoint)
            self.failing = ""
        elif not ok:
            cause = explain(why)
            if cause != self.failing:  # one line per new cause, not one per interval
                log.error("OTLP push to %s failing: %s", self._endpoint, cause)
            self.failing = cause
        return ok
