"""The push's failures: one log line per new cause naming the fix, counted by reason."""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("requests", reason="needs the kvsidecar[otlp] extra")

from kvsidecar.otlp.convert import Batch
from kvsidecar.otlp.errors import explain
from kvsidecar.otlp.push import Pusher

EMPTY = Batch(b"", 0, 0)


@pytest.mark.parametrize(
    "message, hint",
    [
        (
            "SSLError: HTTPSConnectionPool(host='127.0.0.1', port=1): Max retries exceeded "
            "(Caused by SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] "
            "certificate verify failed: self-signed certificate (_ssl.c:1006)')))",
            "--otlp.ca-file",
        ),
        ("ConnectionError: ... [Errno 111] Connection refused'))", "connection refused"),
        ("ReadTimeout: HTTPConnectionPool(...): Read timed out. (read timeout=10)", "in time"),
        ("code: 401", "--otlp.headers-file"),
        ("code: 404", "/v1/metrics"),
        ("answer over 64 KiB", "answer over 64 KiB: is the endpoint an OTLP/HTTP receiver?"),
        ("no complete answer within 10 s", "within 10 s: the collector is slow, or trickles"),
    ],
)
def test_explain_names_the_fix(message: str, hint: str) -> None:
    line = explain(message)
    assert hint in line and "\n" not in line


def test_unknown_cause_is_one_short_line() -> None:
    line = explain("weird\nmulti line\n" + "x" * 500)
    assert "\n" not in line and len(line) <= 203


class _Flaky:
    """A sender failing while ``fail`` is set."""

    endpoint = "http://c:4318/v1/metrics"

    def __init__(self) -> None:
        self.fail = True

    def send(self, body: bytes) -> str:
        return "code: 503" if self.fail else ""

    def close(self) -> None:
        pass


def test_failures_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    exp = _Flaky()
    p = Pusher(list, exp, 3600)
    caplog.set_level(logging.INFO, logger="kvsidecar.otlp")
    for _ in range(5):
        p.send_one(EMPTY)
    assert p.dropped() == {"queue_full": 0, "send_failed": 5}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # not one per interval
    assert "http://c:4318/v1/metrics failing" in errors[0].getMessage()
    exp.fail = False
    p.send_one(EMPTY)
    assert p.failing == "" and "works again" in caplog.records[-1].getMessage()


def test_queue_overflow_counted_as_queue_full() -> None:
    p = Pusher(list, _Flaky(), 3600, maxsize=2)
    for _ in range(5):  # no sender thread: the queue only fills
        p.tick_once()
    assert p.dropped() == {"queue_full": 3, "send_failed": 0}


def test_a_batch_that_fails_to_build_skips_one_push(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def families() -> list:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a family the converter did not expect")
        return []

    p = Pusher(families, _Flaky(), 0.05)
    p.start()
    deadline = time.monotonic() + 60  # an "eventually" on a shared host
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    p.stop()
    assert len(calls) >= 3  # the ticker went on after the failure
    assert any("building a batch failed: ValueError" in r.getMessage() for r in caplog.records)


def test_first_success_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    exp = _Flaky()
    p = Pusher(list, exp, 3600)
    caplog.set_level(logging.INFO, logger="kvsidecar.otlp")
    p.send_one(EMPTY)  # failing first
    exp.fail = False
    for _ in range(3):
        p.send_one(Batch(b"x" * 10, 2, 5))
    exp.fail = True
    p.send_one(EMPTY)
    exp.fail = False
    p.send_one(EMPTY)
    first = [r.getMessage() for r in caplog.records if "first batch accepted" in r.getMessage()]
    assert first == [
        "OTLP push to http://c:4318/v1/metrics: first batch accepted "
        "(2 resources, 5 points, 10 bytes)"
    ]
