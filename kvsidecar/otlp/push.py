"""The push thread: off the serving path, memory bounded, never blocking a scrape.

A ticker thread builds one batch per interval from the collector's families and offers it
to a bounded queue; a sender thread exports. A slow or dead collector only fills the
queue: the oldest batch is dropped (counted), so memory stays at maxsize batches and the
ticker never waits on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from kvsidecar.otlp.convert import Delta, to_metrics_data
from kvsidecar.otlp.errors import Causes, explain

log = logging.getLogger(__name__)


class Pusher:
    def __init__(
        self,
        families: Callable[[], Iterable],
        exporter: MetricExporter,
        interval_s: float,
        delta: bool = False,
        maxsize: int = 4,
        instances: Callable[[], Mapping[str, str]] | None = None,
        causes: Causes | None = None,
        endpoint: str = "the collector",
    ) -> None:
        self._families, self._exporter, self._interval = families, exporter, interval_s
        self._instances = instances  # segment -> runtime.instance, for the Resource
        self._causes, self._endpoint = causes, endpoint
        self.failing = ""  # the one-line cause while exports fail, "" while they succeed
        self._delta = Delta() if delta else None
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._stop = threading.Event()
        self._start_ns = time.time_ns()
        self.stats = {"exported": 0, "failed": 0, "dropped": 0}
        self._threads = [
            threading.Thread(target=self._tick, name="otlp-ticker", daemon=True),
            threading.Thread(target=self._send, name="otlp-sender", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self._exporter.shutdown(timeout_millis=1000)

    def dropped(self) -> dict[str, int]:
        """Batches lost, by reason: the kvsidecar_otlp_dropped_batches_total series."""
        return {"queue_full": self.stats["dropped"], "send_failed": self.stats["failed"]}

    def tick_once(self) -> None:
        """Build one batch and offer it (the ticker's body; tests call it directly)."""
        now = time.time_ns()
        # Two reads of the views: a segment's instance changes only when its writer
        # restarts, so at worst one push names the previous instance.
        instances = self._instances() if self._instances is not None else None
        data = to_metrics_data(self._families(), now, self._start_ns, self._delta, instances)
        if self._delta is not None:
            self._start_ns = now
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

    def send_one(self, data: MetricsData | None) -> bool:
        """Export one batch, count it, and log a change between failing and working."""
        if self._causes is not None:
            self._causes.reset()
        try:
            ok = self._exporter.export(data) is MetricExportResult.SUCCESS
            why = self._causes.text() if self._causes is not None else ""
        except Exception as e:  # an exporter bug must not end the thread
            ok, why = False, f"{type(e).__name__}: {e}"
        self.stats["exported" if ok else "failed"] += 1
        if ok and self.failing:
            log.info("OTLP push to %s works again", self._endpoint)
            self.failing = ""
        elif not ok:
            cause = explain(why or "the exporter gave no reason")
            if cause != self.failing:  # one line per new cause, not one per interval
                log.error("OTLP push to %s failing: %s", self._endpoint, cause)
            self.failing = cause
        return ok
