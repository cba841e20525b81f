"""Why a push failed, in one line naming the fix.

The OTLP exporter returns only FAILURE and logs the cause itself, once per batch and in
its own words (a TLS failure is a 300-character requests repr). We take its log records
instead (`LastError`), keep the last cause, and log one line of our own when the push
starts failing and one when it recovers, not one per interval.
"""

from __future__ import annotations

import logging
from typing import Any

import requests

EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.metric_exporter"

# (substring of the exporter's message, what to do). First match wins.
_HINTS = (
    (
        "CERTIFICATE_VERIFY_FAILED",
        "TLS certificate not trusted: give the collector's CA with --otlp.ca-file",
    ),
    ("SSLError", "TLS handshake failed: check --otlp.ca-file/--otlp.cert-file/--otlp.key-file"),
    ("Connection refused", "connection refused: is the collector listening at the endpoint?"),
    ("code: 401", "HTTP 401: check the token in --otlp.headers-file"),
    ("code: 403", "HTTP 403: check the token in --otlp.headers-file"),
    ("code: 404", "HTTP 404: the endpoint's path is wrong (OTLP/HTTP: /v1/metrics)"),
    ("timed out", "no answer in time: the collector is slow or unreachable"),
    ("timeout", "no answer in time: the collector is slow or unreachable"),
    ("NameResolutionError", "host name does not resolve: check --otlp.endpoint"),
)


def explain(message: str) -> str:
    """The exporter's message as one short line naming the fix."""
    for needle, hint in _HINTS:
        if needle in message:
            return hint
    flat = " ".join(message.split())
    return flat[:200] + ("..." if len(flat) > 200 else "")


class RecordingSession(requests.Session):
    """A requests session (the exporter's `session=`) that remembers the last failure, and
    keeps --otlp.ca-file in force."""

    def __init__(self) -> None:
        super().__init__()
        self.last_error = ""

    def merge_environment_settings(
        self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any
    ) -> dict[str, Any]:
        # requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override a session's own CA file
        # (the exporter puts --otlp.ca-file there): set in many images, it made the push
        # fail against a private CA however --otlp.ca-file was given. Proxies still apply.
        out = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if isinstance(self.verify, str) and verify in (None, True):
            out["verify"] = self.verify
        return out

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:
        try:
            response = super().request(*args, **kwargs)
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            raise
        if response.status_code >= 400:
            self.last_error = f"code: {response.status_code}"
        return response


class LastError(logging.Handler):
    """Keeps the exporter's messages of the current export instead of printing them: the
    retries' warnings name the cause (connection refused), the final error often only
    "timeout, max retries or shutdown"."""

    _KEEP = 8  # an export logs at most 6 retries and a final line: memory stays bounded

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def reset(self) -> None:
        self.messages = []

    def text(self) -> str:
        return " | ".join(self.messages)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not reach the sender thread
            message = str(record.msg)
        self.messages = [*self.messages[-(self._KEEP - 1) :], message]


class Causes:
    """What went wrong in the current export: the session's failure, then the log's."""

    def __init__(self) -> None:
        self.session = RecordingSession()
        self.log = LastError()
        logger = logging.getLogger(EXPORTER_LOGGER)
        logger.handlers = [self.log]  # kept here, not printed once per batch
        logger.propagate = False

    def reset(self) -> None:
        self.session.last_error = ""
        self.log.reset()

    def text(self) -> str:
        return " | ".join(m for m in (self.session.last_error, self.log.text()) if m)
