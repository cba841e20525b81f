"""The daemon's HTTP layer, exporter-toolkit style, independent of where metrics come from.

Routes: the telemetry path (``/metrics``), ``/api/v1/snapshots``, ``/-/healthy``,
``/-/ready`` and a landing page at ``/``. The web config (`webconfig`) adds
TLS, basic auth (never on the health endpoints: probes carry no credentials),
extra headers and a rate limit.

Robustness: one thread per connection, so a slow client or a slow TLS
handshake cannot block accept or other scrapes; a socket timeout drops stalled
clients; ``max_requests`` answers 503 at once above N concurrent requests
instead of queueing (node_exporter's ``--web.max-requests``); stdlib limits on
request line (414) and headers (431).
"""

from __future__ import annotations

import errno
import gzip
import html
import http.server
import logging
import os
import socket
import socketserver
import ssl
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvsidecar.daemon.webconfig import (
    BasicAuth,
    RateLimitConfig,
    WebConfig,
    WebConfigError,
    build_ssl_context,
    load_web_config,
    peer_san_allowed,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUCKETS",
    "HTTPStats",
    "HTTPStatsSnapshot",
    "Handlers",
    "HistogramSnapshot",
    "WebServer",
    "parse_listen_address",
]

SNAPSHOTS_PATH = "/api/v1/snapshots"
HEALTHY_PATH = "/-/healthy"
READY_PATH = "/-/ready"
LANDING_PATH = "/"
OTHER = "other"  # handler label for unknown paths and unparseable requests
_PLAIN = "text/plain; charset=utf-8"


class Handlers(Protocol):
    """What the HTTP layer needs from the rest of the daemon."""

    def metrics(self, accept_header: str) -> tuple[bytes, str]:
        """Exposition body and its content type; the implementation picks OpenMetrics or text."""
        ...

    def snapshots_json(self) -> bytes:
        """The current snapshots as JSON."""
        ...

    def ready(self) -> tuple[bool, str]:
        """(ready, reason); the reason is the 503 body when not ready."""
        ...

    @property
    def landing_links(self) -> Sequence[tuple[str, str]]:
        """Extra (href, text) links for the landing page."""
        ...


# --- self-metrics ------------------------------------------------------------------------------

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
    rejected_connections: int  # closed at once: over max_connections
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


# --- limits ------------------------------------------------------------------------------------


class _Limiter:
    """At most ``limit`` holders (0 = unlimited); ``try_acquire`` never waits."""

    def __init__(self, limit: int) -> None:
        self._sem = threading.BoundedSemaphore(limit) if limit > 0 else None

    def try_acquire(self) -> bool:
        return self._sem is None or self._sem.acquire(blocking=False)

    def release(self) -> None:
        if self._sem is not None:
            self._sem.release()


class _TokenBucket:
    """exporter-toolkit's ``rate_limit``: one token per interval, up to ``burst``."""

    def __init__(self, cfg: RateLimitConfig) -> None:
        self.cfg = cfg
        self._tokens = float(cfg.burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            refill = (now - self._last) / self.cfg.interval_s
            self._tokens = min(float(self.cfg.burst), self._tokens + refill)
            self._last = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


# --- live web config ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _State:
    cfg: WebConfig | None
    ssl_context: ssl.SSLContext | None
    auth: BasicAuth
    bucket: _TokenBucket | None

    @classmethod
    def build(cls, cfg: WebConfig | None, previous: _State | None = None) -> _State:
        if cfg is None:
            return cls(None, None, BasicAuth({}), None)
        ctx = build_ssl_context(cfg.tls) if cfg.tls is not None else None
        users = dict(cfg.basic_auth_users)
        # Keep the bcrypt cache and the token bucket across reloads that don't change them.
        if previous is not None and previous.auth.users == users:
            auth = previous.auth
        else:
            auth = BasicAuth(users)
        bucket = None
        if cfg.rate_limit is not None:
            old = previous.bucket if previous is not None else None
            bucket = (
                old
                if old is not None and old.cfg == cfg.rate_limit
                else _TokenBucket(cfg.rate_limit)
            )
        return cls(cfg, ctx, auth, bucket)


def _stamp(paths: Sequence[str]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)  # follows symlinks: Kubernetes swaps a ..data symlink on update
            out.append((p, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append((p, None))
    return tuple(out)


class _LiveConfig:
    """The current web config. Like exporter-toolkit, the file is re-read when it or a
    certificate changes, so rotated certificates and users apply without a restart;
    a broken new version is logged and the last good one stays in force."""

    def __init__(self, cfg: WebConfig | None, check_interval_s: float) -> None:
        self._state = _State.build(cfg)
        self._interval = check_interval_s
        self._stamp = _stamp(cfg.files) if cfg is not None and cfg.path else None
        self._next = time.monotonic() + check_interval_s
        self._lock = threading.Lock()

    def current(self) -> _State:
        if self._stamp is None or time.monotonic() < self._next:
            return self._state
        with self._lock:
            if time.monotonic() < self._next:
                return self._state
            self._next = time.monotonic() + self._interval
            old = self._state
            assert old.cfg is not None and old.cfg.path is not None
            stamp = _stamp(old.cfg.files)
            if stamp == self._stamp:
                return old
            self._stamp = stamp  # don't retry a broken file until it changes again
            try:
                cfg = load_web_config(old.cfg.path)
                if (cfg.tls is None) != (old.cfg.tls is None):
                    raise WebConfigError(
                        f"{cfg.path}: TLS can only be turned on or off with a restart"
                    )
                self._state = _State.build(cfg, previous=old)
                self._stamp = _stamp(cfg.files)
            except (WebConfigError, OSError) as e:
                log.error("web config changed but is invalid, keeping the previous one: %s", e)
                return old
            log.info("reloaded web config %s", cfg.path)
            return self._state


# --- listen addresses --------------------------------------------------------------------------


def parse_listen_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` as Go does: ``:9400`` (all interfaces), ``0.0.0.0:9400``,
    ``[::1]:9400``, ``localhost:0``. Raises ValueError with the accepted forms."""
    hint = "use host:port, :port or [ipv6]:port"
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"invalid listen address {address!r}: {hint}")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError(f"invalid listen address {address!r}: missing port; {hint}")
        if ":" in host:
            raise ValueError(
                f"invalid listen address {address!r}: IPv6 needs brackets, e.g. [::1]:9400"
            )
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"invalid listen address {address!r}: port must be 0-65535")
    return host, int(port_text)


def _format_address(sockaddr: tuple) -> str:
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- server ------------------------------------------------------------------------------------


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """One listening socket. socketserver.TCPServer rather than http.server.HTTPServer:
    the latter calls getfqdn() on bind, a DNS lookup that can stall startup."""

    daemon_threads = True
    block_on_close = False  # shutdown must not wait for stalled clients
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self, sockaddr: tuple, family: socket.AddressFamily, web: WebServer, dualstack: bool = False
    ) -> None:
        self.address_family = family
        self.web = web
        super().__init__(sockaddr, _RequestHandler, bind_and_activate=False)
        try:
            if dualstack:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        sock.settimeout(self.web.request_timeout_s)  # bounds the handshake and every read
        return sock, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.web._connections.try_acquire():
            self.web.stats.connection_rejected()
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection thread
        except BaseException:
            self.web._connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        conn = request
        linger = False
        try:
            state = self.web._live.current()
            if state.ssl_context is not None:
                conn = self._handshake(request, client_address, state)
                if conn is None:
                    return
            handler = _RequestHandler(conn, client_address, self)
            linger = handler.linger
        except Exception:
            self.handle_error(conn, client_address)
        finally:
            if conn is not None:
                self._close(conn, linger)
            self.web._connections.release()

    def _handshake(
        self, sock: socket.socket, client_address: Any, state: _State
    ) -> ssl.SSLSocket | None:
        # Here, in the connection's thread, so a slow or silent TLS client costs
        # only its own thread; the socket timeout bounds it.
        assert state.ssl_context is not None and state.cfg is not None
        tls = state.cfg.tls
        conn = state.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            conn.do_handshake()
            if (
                tls is not None
                and tls.client_allowed_sans
                and not peer_san_allowed(conn.getpeercert(), tls.client_allowed_sans)
            ):
                raise ssl.SSLError("client certificate SANs not in client_allowed_sans")
        except (OSError, ValueError) as e:
            self.web.stats.tls_handshake_failed()
            log.debug("TLS handshake with %s failed: %s", client_address, e)
            conn.close()
            return None
        return conn

    def _close(self, conn: socket.socket, linger: bool) -> None:
        try:
            conn.shutdown(socket.SHUT_WR)
            if linger:
                # After an error reply the client may still be sending (a huge header):
                # closing with unread data sends RST, which can destroy the reply before
                # the client reads it. Drain briefly first, as Go's net/http does.
                deadline = time.monotonic() + 1.0
                received = 0
                while received < (1 << 20) and (left := deadline - time.monotonic()) > 0:
                    conn.settimeout(left)
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    received += len(chunk)
        except (OSError, ValueError):
            pass
        finally:
            conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # reset, broken pipe, timeout: the client's doing
            log.debug("connection from %s ended: %s", client_address, exc)
        else:
            log.exception("error serving %s", client_address)


class _RequestHandler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses connections
    server_version = "kvsidecar"
    sys_version = ""  # don't advertise the Python version
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    # Errors for unparseable request lines get a status line and headers (the stdlib
    # default, HTTP/0.9, sends a bare body that no client can interpret).
    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        self.linger = False
        self._route = OTHER
        self._code: int | None = None
        self._t0: float | None = None
        super().setup()

    # -- bookkeeping --

    def handle_one_request(self) -> None:
        self._route, self._code, self._t0 = OTHER, None, None
        try:
            super().handle_one_request()
        finally:
            if self._code is not None:
                now = time.monotonic()
                self.server.web.stats.observe(self._route, self._code, now - (self._t0 or now))

    def parse_request(self) -> bool:
        self._t0 = time.monotonic()  # after the request line arrived: not keep-alive idle time
        if not super().parse_request():
            return False
        if len(self.requestline.split()) != 3:
            self.close_connection = True
            self.send_error(400, "HTTP/0.9 requests are not supported")
            return False
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True  # a body may follow that we won't read
            self._send(405, b"405 method not allowed\n", {"Allow": "GET, HEAD"})
            return False
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") != "0":
            self.close_connection = True  # a GET with a body: unread, so no keep-alive
        return True

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if isinstance(code, int) or str(code).isdigit():
            self._code = int(code)
        if self._code is not None and self._code >= 400:
            self.linger = True
        log.debug('%s "%s" %s', self.address_string(), self.requestline, code)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # -- serving --

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def _serve(self) -> None:
        web = self.server.web
        path = urlsplit(self.path).path
        route = web._routes.get(path)
        self._route = route or OTHER
        state = web._live.current()
        headers = dict(state.cfg.http.headers) if state.cfg is not None else {}

        if route == HEALTHY_PATH:
            # Always 200 while serving, never behind auth: probes carry no credentials.
            self._send(200, b"OK", headers)
            return
        if route == READY_PATH:
            try:
                ok, reason = web.handlers.ready()
            except Exception as e:
                log.exception("readiness check failed")
                ok, reason = False, f"readiness check failed: {e}"
            self._send(
                200 if ok else 503, b"OK" if ok else (reason or "not ready").encode(), headers
            )
            return
        if state.bucket is not None and not state.bucket.allow():
            self._send(429, b"429 too many requests\n", headers)
            return
        if state.auth.enabled and not state.auth.check_header(self.headers.get("Authorization")):
            headers["WWW-Authenticate"] = f'Basic realm="{web.realm}"'
            self._send(401, b"401 unauthorized\n", headers)
            return
        if route is None:
            self._send(404, b"404 page not found\n", headers)
            return
        if not web._requests.try_acquire():
            # Refuse at once rather than queue: a queued scrape would time out anyway.
            self._send(503, b"503 too many concurrent requests, try again later\n", headers)
            return
        web.stats.request_started()
        try:
            body, ctype = self._render(route)
            headers["Vary"] = "Accept-Encoding"
            if _accepts_gzip(self.headers.get("Accept-Encoding", "")):
                body = _gzip_cached(body)
                headers["Content-Encoding"] = "gzip"
        except Exception:
            log.exception("rendering %s failed", route)
            self._send(500, b"500 internal server error, see the kvsidecar log\n", headers)
            return
        finally:
            web.stats.request_finished()
            web._requests.release()
        self._send(200, body, headers, ctype)

    def _render(self, route: str) -> tuple[bytes, str]:
        web = self.server.web
        if route == web.telemetry_path:
            return web.handlers.metrics(self.headers.get("Accept", ""))
        if route == SNAPSHOTS_PATH:
            return web.handlers.snapshots_json(), "application/json"
        return web.landing_page(), "text/html; charset=utf-8"

    def _send(
        self, code: int, body: bytes, headers: Mapping[str, str], content_type: str = _PLAIN
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


_gzip_last: tuple[bytes, bytes] = (b"", gzip.compress(b"", mtime=0))


def _gzip_cached(body: bytes) -> bytes:
    """Compress, reusing the last result for the same body object.

    The daemon renders /metrics once per poll and hands every scrape the same
    bytes object; compressing 200 KB costs ~3 ms, so repeat scrapes reuse it.
    """
    global _gzip_last
    last_body, last_gz = _gzip_last
    if body is last_body:
        return last_gz
    gz = gzip.compress(body, compresslevel=6, mtime=0)
    _gzip_last = (body, gz)  # one tuple store: atomic for concurrent handler threads
    return gz


def _accepts_gzip(accept_encoding: str) -> bool:
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip"):
            continue
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        return q > 0
    return False


class WebServer:
    """The daemon's HTTP(S) server on one or more listen addresses.

    ``max_requests`` caps requests rendered at once (0 = unlimited; health
    endpoints are exempt), ``max_connections`` caps open connections (each costs
    a thread), ``request_timeout_s`` drops clients that stall a read or handshake.
    """

    def __init__(
        self,
        handlers: Handlers,
        listen_addresses: Sequence[str],
        *,
        telemetry_path: str = "/metrics",
        web_config: WebConfig | None = None,
        max_requests: int = 40,
        max_connections: int = 256,
        request_timeout_s: float = 15.0,
        stats: HTTPStats | None = None,
        realm: str = "kvsidecar",
        title: str = "kvsidecar",
        version: str | None = None,
        config_check_interval_s: float = 1.0,
    ) -> None:
        if not listen_addresses:
            raise ValueError("at least one listen address is required")
        self._listen = [(a, *parse_listen_address(a)) for a in listen_addresses]
        if not telemetry_path.startswith("/") or telemetry_path in (
            LANDING_PATH,
            SNAPSHOTS_PATH,
            HEALTHY_PATH,
            READY_PATH,
        ):
            raise ValueError(
                f"invalid telemetry path {telemetry_path!r}: it must start with / "
                "and not be /, /api/v1/snapshots, /-/healthy or /-/ready"
            )
        if max_requests < 0 or max_connections < 0:
            raise ValueError("max_requests and max_connections must be >= 0 (0 = unlimited)")
        self.handlers = handlers
        self.telemetry_path = telemetry_path
        self.request_timeout_s = request_timeout_s
        self.stats = stats if stats is not None else HTTPStats()
        self.realm = realm
        self.title = title
        self.version = version
        self._routes = {
            p: p for p in (telemetry_path, SNAPSHOTS_PATH, HEALTHY_PATH, READY_PATH, LANDING_PATH)
        }
        self._requests = _Limiter(max_requests)
        self._connections = _Limiter(max_connections)
        self._live = _LiveConfig(web_config, config_check_interval_s)
        for note in web_config.notes if web_config is not None else ():
            log.warning("web config: %s", note)
        self._servers: list[_Server] = []
        self._threads: list[threading.Thread] = []

    @property
    def tls(self) -> bool:
        return self._live.current().ssl_context is not None

    @property
    def addresses(self) -> list[str]:
        """The bound addresses as host:port ([v6]:port), with real ports for port 0."""
        return [_format_address(s.socket.getsockname()) for s in self._servers]

    def start(self) -> None:
        """Bind every address (all or none), then serve each from its own thread."""
        if self._servers:
            raise RuntimeError("WebServer already started")
        try:
            for text, host, port in self._listen:
                try:
                    self._servers.append(self._bind(host, port))
                except OSError as e:
                    raise OSError(e.errno, f"cannot listen on {text}: {e.strerror or e}") from e
        except BaseException:
            for srv in self._servers:
                srv.server_close()
            self._servers.clear()
            raise
        scheme = "https" if self.tls else "http"
        for srv in self._servers:
            addr = _format_address(srv.socket.getsockname())
            t = threading.Thread(
                target=srv.serve_forever,
                kwargs={"poll_interval": 0.2},
                name=f"kvsidecar-http {addr}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)
            log.info("listening on %s://%s", scheme, addr)

    def _bind(self, host: str, port: int) -> _Server:
        if host == "":
            # ":port" means every interface: IPv6 dual-stack when the kernel has it.
            if socket.has_dualstack_ipv6():
                try:
                    return _Server(("::", port), socket.AF_INET6, self, dualstack=True)
                except OSError as e:
                    if e.errno == errno.EADDRINUSE:
                        raise
            return _Server(("0.0.0.0", port), socket.AF_INET, self)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        return _Server(sockaddr, family, self)

    def shutdown(self) -> None:
        """Stop accepting and close the listeners; in-flight requests finish on their own."""
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._servers.clear()
        self._threads.clear()

    def __enter__(self) -> WebServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def landing_page(self) -> bytes:
        links = [
            (self.telemetry_path, "Metrics"),
            (SNAPSHOTS_PATH, "Snapshots (JSON)"),
            (HEALTHY_PATH, "Health"),
            (READY_PATH, "Readiness"),
            *self.handlers.landing_links,
        ]
        items = "\n".join(
            # "./metrics" rather than "/metrics": works behind a path-prefix proxy too.
            f'<li><a href="{html.escape("." + href if href.startswith("/") else href)}">'
            f"{html.escape(text)}</a></li>"
            for href, text in links
        )
        title = html.escape(self.title)
        version = f"<p>Version: {html.escape(self.version)}</p>\n" if self.version else ""
        return (
            '<!DOCTYPE html>\n<html>\n<head><meta charset="utf-8">'
            f"<title>{title}</title></head>\n<body>\n<h1>{title}</h1>\n"
            f"<p>KV-cache monitoring sidecar</p>\n{version}<ul>\n{items}\n</ul>\n</body>\n</html>\n"
        ).encode()
