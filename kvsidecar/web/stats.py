"""Request statistics the server keeps: counts and durations per route, in-flight requests,
rejected connections and failed TLS handshakes. Plain data; whoever exports them (the
daemon's collector) turns them into metrics."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_BUCKETS", "HTTPStats", "HTTPStatsSnapshot", "HistogramSnapshot"]

# prometheus_client's default buckets: scrapes are ms, a busy daemon may take seconds.
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Cumulative buckets as (upper bound, count), the last bound is +Inf; ready for
    ``HistogramMetricFamily(buckets=[(str(le), n) ...], sum_value=sum)``."""

    buckets: tuple[tuple[float, int], ...]
    sum: float
    count: int


@dataclass(frozen=True)
class HTTPStatsSnapshot:
    requests: Mapping[tuple[str, str], int]  # (handler, code) -> requests
    durations: Mapping[str, HistogramSnapshot]  # handler -> request duration seconds
    in_flight: int  # requests being rendered now (the ones max_requests counts)
    rejected_connections: int  # closed for max_connections: the longest-waiting, or a newcomer
    tls_handshake_errors: int  # failed handshakes, refused protocol versions, SAN mismatches


class HTTPStats:
    """Thread-safe request counters and duration histograms, keyed by a bounded
    handler label (the route, or ``other``), never the raw path."""

    def __init__(self, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self.bounds = (*sorted(buckets), float("inf"))
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._hist: dict[str, list[float]] = {}  # per-bucket counts, then sum, then count
        self._in_flight = 0
        self._rejected = 0
        self._tls_errors = 0

    def observe(self, handler: str, code: int, seconds: float) -> None:
        with self._lock:
            key = (handler, str(code))
            self._requests[key] = self._requests.get(key, 0) + 1
            h = self._hist.get(handler)
            if h is None:
                h = self._hist[handler] = [0.0] * (len(self.bounds) + 2)
            for i, bound in enumerate(self.bounds):
                if seconds <= bound:
                    h[i] += 1
                    break
            h[-2] += seconds
            h[-1] += 1

    def _add(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def request_started(self) -> None:
        self._add("_in_flight", 1)

    def request_finished(self) -> None:
        self._add("_in_flight", -1)

    def connection_rejected(self) -> None:
        self._add("_rejected", 1)

    def tls_handshake_failed(self) -> None:
        self._add("_tls_errors", 1)

    def snapshot(self) -> HTTPStatsSnapshot:
        with self._lock:
            durations = {}
            for handler, h in self._hist.items():
                running, buckets = 0, []
                for bound, n in zip(self.bounds, h, strict=False):
                    running += int(n)
                    buckets.append((bound, running))
                durations[handler] = HistogramSnapshot(tuple(buckets), h[-2], int(h[-1]))
            return HTTPStatsSnapshot(
                requests=dict(self._requests),
                durations=durations,
                in_flight=self._in_flight,
                rejected_connections=self._rejected,
                tls_handshake_errors=self._tls_errors,
            )
