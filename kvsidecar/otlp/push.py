"""The push thread: off the serving path, memory bounded, never blocking a scrape.

A ticker thread builds one batch per interval from the collector's families and offers it
to a bounded queue; a sender thread exports. A slow or dead collector only fills the
queue: the oldest batch is dropped (counted), so memory stays at maxsize batches and the
ticker never waits on the network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

from kvsidecar.otlp.convert import Delta, to_metrics_data


class Pusher:
    def __init__(
        self,
        families: Callable[[], Iterable],
        exporter: MetricExporter,
        interval_s: float,
        delta: bool = False,
        maxsize: int = 4,
    ) -> None:
        self._families, self._exporter, self._interval = families, exporter, interval_s
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

    def tick_once(self) -> None:
        """Build one batch and offer it (the ticker's body; tests call it directly)."""
        now = time.time_ns()
        data = to_metrics_data(self._families(), now, self._start_ns, self._delta)
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
        while not self._stop.wait(self._interval):
            self.tick_once()

    def _send(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                ok = self._exporter.export(data) is MetricExportResult.SUCCESS
            except Exception:  # an exporter bug must not end the thread
                ok = False
            self.stats["exported" if ok else "failed"] += 1
