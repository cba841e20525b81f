"""POSTing a batch to the collector: the answer is bounded in bytes and each export in time.

What the collector sends back is a network input like any other (issue 43): a 200 with a
300 MB body, or a gzip bomb, took the SDK exporter's transport (requests, which reads and
decompresses the whole body) to 650 MB of RSS; an answer trickled a byte every 0.5 s held
the one sender thread for ever (requests' timeout is per read). Here:

- every byte of an answer (status line, headers, body) goes through `_BoundedReader`:
  at most `ANSWER_MAX_BYTES` per answer, and no read past the export's deadline;
- the body is read as it came (never decompressed) and thrown away: an OTLP client needs
  only the status and Retry-After;
- the export's deadline covers the connect and TLS handshake, sending the batch, every
  read, and the retries with their backoff: one clock per export, not one per read.

requests and urllib3 stay (proxies from the environment, TLS as users configure it); the
bounds live in the urllib3 connection classes of one adapter, mounted on our session only.
"""

from __future__ import annotations

import gzip
import http.client
import io
import random
import threading
import time
from typing import Any

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from kvsidecar import __version__

ANSWER_MAX_BYTES = 64 * 1024  # an OTLP answer is a few hundred bytes; a proxy's page a few KiB
RETRYABLE = frozenset({429, 502, 503, 504})  # the OTLP/HTTP specification's list
_MIN_TIMEOUT = 0.001  # a socket timeout of 0 would mean non-blocking


class AnswerRefused(Exception):
    """The collector's answer broke a bound: not retried (a hostile or broken collector)."""


class Budget:
    """One export's deadline and the byte bound of each answer."""

    def __init__(self, seconds: float, max_bytes: int = ANSWER_MAX_BYTES) -> None:
        self.seconds, self.max_bytes = seconds, max_bytes
        self.deadline = time.monotonic() + seconds

    def start(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self) -> float:
        return max(self.remaining(), _MIN_TIMEOUT)

    def late(self) -> str:
        return f"no complete answer within {self.seconds:g} s"


_active = threading.local()  # the Budget of the export this thread is doing, if any


def _budget() -> Budget | None:
    return getattr(_active, "budget", None)


class _BoundedReader(io.RawIOBase):
    """The answer's bytes from the socket, within the budget's bytes and deadline."""

    def __init__(self, raw: Any, sock: Any, budget: Budget) -> None:
        super().__init__()
        self._raw, self._sock, self._budget, self._got = raw, sock, budget, 0
        self._per_read = sock.gettimeout()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        if self._budget.remaining() <= 0:
            raise AnswerRefused(self._budget.late())
        timeout = self._budget.timeout()
        if self._per_read is not None:
            timeout = min(timeout, self._per_read)
        self._sock.settimeout(timeout)
        n = self._raw.readinto(b)
        self._got += n or 0
        if self._got > self._budget.max_bytes:
            raise AnswerRefused(f"answer over {self._budget.max_bytes // 1024} KiB")
        return n

    def close(self) -> None:
        self._raw.close()  # the socket's makefile reference: the connection may close now
        super().close()


class _BoundedResponse(http.client.HTTPResponse):
    def __init__(self, sock: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        budget = _budget()
        if budget is not None:  # nothing read yet: swap the file under http.client's parser
            self.fp = io.BufferedReader(_BoundedReader(self.fp.detach(), sock, budget))


class _Deadlined:
    """The connect, the TLS handshake (its timeout is the whole handshake's) and each send
    of the request get what is left of the export's deadline."""

    response_class = _BoundedResponse

    def _new_conn(self) -> Any:
        sock = super()._new_conn()  # type: ignore[misc]
        budget = _budget()
        if budget is not None:
            sock.settimeout(budget.timeout())
        return sock

    def send(self, data: Any) -> None:
        budget = _budget()
        if budget is not None and self.sock is not None:  # type: ignore[attr-defined]
            self.sock.settimeout(budget.timeout())  # type: ignore[attr-defined]
        super().send(data)  # type: ignore[misc]


class _Conn(_Deadlined, HTTPConnection):
    pass


class _TLSConn(_Deadlined, HTTPSConnection):
    pass


class _Pool(HTTPConnectionPool):
    ConnectionCls = _Conn


class _TLSPool(HTTPSConnectionPool):
    ConnectionCls = _TLSConn


_POOLS = {"http": _Pool, "https": _TLSPool}


class _Adapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        if not proxy.lower().startswith("socks"):  # SOCKS brings connection classes of its own
            manager.pool_classes_by_scheme = _POOLS
        return manager


class CollectorSession(requests.Session):
    """A requests session whose answers are bounded, and which keeps --otlp.ca-file in
    force over REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE."""

    def __init__(self, budget: Budget) -> None:
        super().__init__()
        self.budget = budget
        self.mount("http://", _Adapter())
        self.mount("https://", _Adapter())

    def merge_environment_settings(
        self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any
    ) -> dict[str, Any]:
        # requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override a session's own CA file:
        # set in many images, it made the push fail against a private CA however
        # --otlp.ca-file was given. Proxies still apply.
        out = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if isinstance(self.verify, str) and verify in (None, True):
            out["verify"] = self.verify
        return out

    def post_bounded(self, url: str, body: bytes, headers: dict[str, str]) -> requests.Response:
        """POST within the budget; the answer's body is read (raw) and dropped."""
        _active.budget = self.budget
        try:
            timeout = self.budget.timeout()
            r = self.post(
                url, data=body, headers=headers, timeout=timeout, stream=True, allow_redirects=False
            )
            try:
                while r.raw.read(16384, decode_content=False):
                    pass
            finally:
                r._content, r._content_consumed = b"", True
                r.close()
            return r
        finally:
            _active.budget = None


class Sender:
    """Exports one encoded batch: the OTLP/HTTP retry rules (429, 502, 503, 504 and
    connection errors, exponential backoff or Retry-After) inside one deadline."""

    def __init__(
        self,
        endpoint: str,
        headers: dict[str, str] | None = None,
        timeout_s: float = 10.0,
        gzip_body: bool = False,
        verify: bool | str = True,
        cert: str | tuple[str, str] | None = None,
        max_bytes: int = ANSWER_MAX_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self.budget = Budget(timeout_s, max_bytes)
        self.session = CollectorSession(self.budget)
        self.session.verify = verify
        if cert is not None:
            self.session.cert = cert
        self._gzip = gzip_body
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": f"kvsidecar/{__version__}",
            **({"Content-Encoding": "gzip"} if gzip_body else {}),
            **(headers or {}),
        }
        self._stop = threading.Event()

    def send(self, body: bytes) -> str:
        """ "" when the collector accepted the batch, else why not (one line)."""
        self.budget.start()
        data = gzip.compress(body, compresslevel=6) if self._gzip else body
        for attempt in range(8):
            retry_after = None
            try:
                r = self.session.post_bounded(self.endpoint, data, self._headers)
            except AnswerRefused as e:
                return str(e)
            except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
                # (urllib3's own: the body is read from the raw response, below requests)
                if self.budget.remaining() <= 0:
                    return self.budget.late()
                cause, retry = f"{type(e).__name__}: {e}", True
            else:
                if 200 <= r.status_code < 300:
                    return ""
                cause, retry = f"code: {r.status_code}", r.status_code in RETRYABLE
                retry_after = _seconds(r.headers.get("Retry-After"))
            backoff = retry_after if retry_after is not None else 2**attempt
            backoff *= random.uniform(0.8, 1.2)
            if not retry or backoff >= self.budget.remaining():
                return cause
            if self._stop.wait(backoff):
                return cause
        return cause

    def close(self) -> None:
        self._stop.set()
        self.session.close()


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare for OTLP; the exponential backoff instead
