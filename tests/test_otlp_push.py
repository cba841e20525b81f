"""The push thread against a real OTLP/HTTP receiver on loopback: live, stalled, dead."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("requests", reason="needs kvsidecar[otlp]")
pytest.importorskip("opentelemetry.proto", reason="needs kvsidecar[otlp]")

from prometheus_client.core import CounterMetricFamily

from kvsidecar.daemon.metric_defs import RANK_LABELS
from kvsidecar.otlp.push import Pusher
from kvsidecar.otlp.transport import Sender
from tests.support.otlp_receiver import start_receiver

WAIT_S = 60.0  # generous: a shared 2-core host; never a bound on speed


def _families():
    f = CounterMetricFamily("kvsidecar_engine_steps", "", labels=RANK_LABELS)
    f.add_metric(["s", "vllm", "m", "decode", "0", "0", "0"], 7)
    return [f]


def _until(cond) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cond()


def test_push_reaches_the_receiver() -> None:
    srv, got = start_receiver()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/metrics"
    p = Pusher(_families, Sender(url, timeout_s=5), 0.05)
    p.start()
    _until(lambda: len(got) >= 2)
    p.stop()
    srv.shutdown()
    m = got[0].resource_metrics[0].scope_metrics[0].metrics[0]
    assert (m.name, m.sum.data_points[0].as_int) == ("kvsidecar.engine.steps", 7)


def test_stalled_receiver_drops_counted_memory_bounded() -> None:
    stall = threading.Event()
    srv, _ = start_receiver(stall)
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/metrics"
    p = Pusher(_families, Sender(url, timeout_s=30), 3600, maxsize=2)
    p.start()
    for _ in range(10):  # the ticker's body: never blocks on the stalled network
        p.tick_once()
    assert p._queue.qsize() <= 2
    _until(lambda: p.stats["dropped"] >= 7)
    stall.set()
    p.stop()
    srv.shutdown()


def test_dead_receiver_counts_failures() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    p = Pusher(_families, Sender(f"http://127.0.0.1:{port}/v1/metrics", timeout_s=2), 3600)
    p.start()
    p.tick_once()
    _until(lambda: p.stats["failed"] >= 1)
    p.stop()
