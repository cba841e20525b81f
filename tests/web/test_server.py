"""The HTTP layer over real sockets: routes, auth, TLS, limits, slow and malformed clients."""

from __future__ import annotations

import base64
import gzip
import http.client
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest

from kvsidecar.daemon.endpoints import WebServer
from kvsidecar.web import server as web_server
from kvsidecar.web.config import WebConfig
from kvsidecar.web.config_file import load_web_config, parse_web_config
from kvsidecar.web.listen_address import parse_listen_address
from kvsidecar.web.stats import HTTPStats

METRICS = b"# HELP kv_test A test gauge.\n# TYPE kv_test gauge\n" + b"kv_test 1\n" * 200
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PASSWORD_HASH = bcrypt.hashpw(b"right", bcrypt.gensalt(4)).decode()  # cost 4: fast tests


class FakeHandlers:
    """A Handlers implementation; ``gate`` makes metrics() block until set."""

    landing_links = [("https://example.com/docs", "Docs <external>")]

    def __init__(self) -> None:
        self.is_ready = (True, "")
        self.gate: threading.Event | None = None
        self.entered = threading.Semaphore(0)
        self.accepts: list[str] = []
        self.fail = False

    def metrics(self, accept_header: str) -> tuple[bytes, str]:
        self.accepts.append(accept_header)
        self.entered.release()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("boom")
        return METRICS, METRICS_TYPE

    def snapshots_json(self) -> bytes:
        return b'{"snapshots": []}'

    def ready(self) -> tuple[bool, str]:
        return self.is_ready


@pytest.fixture
def handlers() -> FakeHandlers:
    return FakeHandlers()


@pytest.fixture
def serve(handlers: FakeHandlers) -> Iterator[Callable[..., WebServer]]:
    """Start WebServers on 127.0.0.1:0 (unless told otherwise); shut them down after."""
    servers: list[WebServer] = []

    def start(addresses: tuple[str, ...] = ("127.0.0.1:0",), **kwargs: object) -> WebServer:
        kwargs.setdefault("request_timeout_s", 2.0)
        server = WebServer(handlers, addresses, **kwargs)  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def port_of(server: WebServer, i: int = 0) -> int:
    return int(server.addresses[i].rsplit(":", 1)[1])


def request(
    server: WebServer,
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    auth: str | None = None,
    context: ssl.SSLContext | None = None,
    timeout: float = 5.0,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    if context is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "localhost", port_of(server), timeout=timeout, context=context
        )
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=timeout)
    headers = dict(headers or {})
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def raw(server: WebServer, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


# --- certificates ------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """server.{crt,key} (self-signed, localhost), ca.{crt,key} and client.{crt,key}
    (SAN scraper.example, signed by the CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", *_EC, "-keyout", f"{d}/server.key", "-out", f"{d}/server.crt",
             "-days", "2", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1")  # fmt: skip
    _openssl("req", "-x509", *_EC, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt",
             "-days", "2", "-subj", "/CN=kvsidecar test CA")  # fmt: skip
    _openssl("req", *_EC, "-keyout", f"{d}/client.key", "-out", f"{d}/client.csr",
             "-subj", "/CN=scraper")  # fmt: skip
    (d / "client.ext").write_text("subjectAltName=DNS:scraper.example\n")
    _openssl("x509", "-req", "-in", f"{d}/client.csr", "-CA", f"{d}/ca.crt",
             "-CAkey", f"{d}/ca.key", "-CAcreateserial", "-out", f"{d}/client.crt",
             "-days", "2", "-extfile", f"{d}/client.ext")  # fmt: skip
    return d


def tls_config(pki: Path, extra: str = "") -> WebConfig:
    return parse_web_config(
        f"tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n{extra}"
    )


def client_context(
    pki: Path,
    *,
    min_version: ssl.TLSVersion | None = None,
    max_version: ssl.TLSVersion | None = None,
    client_cert: bool = False,
) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki / "server.crt")
    if min_version is not None:
        ctx.minimum_version = min_version
    if max_version is not None:
        ctx.maximum_version = max_version
    if client_cert:
        ctx.load_cert_chain(pki / "client.crt", pki / "client.key")
    return ctx


def tls_handshake(server: WebServer, ctx: ssl.SSLContext) -> str:
    """Handshake only; returns the negotiated version or raises."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=5) as sock:
        with ctx.wrap_socket(sock, server_hostname="localhost") as tls:
            version = tls.version()
            assert version is not None
            return version


# --- routes ------------------------------------------------------------------------------------


def test_routes(serve: Callable[..., WebServer], handlers: FakeHandlers) -> None:
    server = serve()
    status, headers, body = request(server, "/metrics", headers={"Accept": "text/plain"})
    assert (status, body, headers["Content-Type"]) == (200, METRICS, METRICS_TYPE)
    assert handlers.accepts == ["text/plain"], "the Accept header reaches metrics()"
    assert request(server, "/metrics?name[]=kv_test")[0] == 200, "query strings are ignored"

    status, headers, body = request(server, "/api/v1/snapshots")
    assert (status, headers["Content-Type"]) == (200, "application/json")
    assert body == b'{"snapshots": []}'

    assert request(server, "/-/healthy")[::2] == (200, b"OK")
    assert request(server, "/-/ready")[::2] == (200, b"OK")
    handlers.is_ready = (False, "no engine segment found in /dev/shm")
    assert request(server, "/-/ready")[::2] == (503, b"no engine segment found in /dev/shm")
    assert request(server, "/-/healthy")[0] == 200, "healthy does not depend on readiness"

    status, headers, body = request(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    for link in (b'href="./metrics"', b'href="./api/v1/snapshots"', b'href="./-/healthy"',
                 b'href="./-/ready"', b'href="https://example.com/docs"',
                 b"Docs &lt;external&gt;"):  # fmt: skip
        assert link in body

    for path in ("/nope", "/metrics/", "/index.html", "/-/"):
        assert request(server, path)[0] == 404, path


def test_head_and_other_methods(serve: Callable[..., WebServer]) -> None:
    server = serve()
    status, headers, body = request(server, "/metrics", method="HEAD")
    assert (status, body) == (200, b"")
    assert int(headers["Content-Length"]) == len(METRICS)
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
        status, headers, _ = request(server, "/metrics", method=method)
        assert status == 405 and headers["Allow"] == "GET, HEAD", method
    assert request(server, "/metrics")[0] == 200


def test_custom_telemetry_path(serve: Callable[..., WebServer]) -> None:
    server = serve(telemetry_path="/kv/metrics")
    assert request(server, "/kv/metrics")[0] == 200
    assert request(server, "/metrics")[0] == 404
    assert b'href="./kv/metrics"' in request(server, "/")[2]
    for bad in ("metrics", "/", "/-/ready"):
        with pytest.raises(ValueError, match="invalid telemetry path"):
            WebServer(FakeHandlers(), ["127.0.0.1:0"], telemetry_path=bad)


def test_keep_alive(serve: Callable[..., WebServer]) -> None:
    server = serve()
    conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert response.status == 200 and response.read() == METRICS
        sock = conn.sock
        conn.request("GET", "/-/healthy")
        conn.getresponse().read()
        assert conn.sock is sock, "the connection was reused"
    finally:
        conn.close()


def test_handler_error_is_500_and_server_survives(
    serve: Callable[..., WebServer], handlers: FakeHandlers
) -> None:
    server = serve()
    handlers.fail = True
    assert request(server, "/metrics")[0] == 500
    handlers.fail = False
    assert request(server, "/metrics")[0] == 200


def test_gzip(serve: Callable[..., WebServer]) -> None:
    server = serve()
    status, headers, body = request(server, "/metrics", headers={"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert headers["Vary"] == "Accept-Encoding"
    assert int(headers["Content-Length"]) == len(body) < len(METRICS)
    assert gzip.decompress(body) == METRICS

    for encoding in ("", "identity", "gzip;q=0", "br, deflate"):
        _, headers, body = request(server, "/metrics", headers={"Accept-Encoding": encoding})
        assert "Content-Encoding" not in headers and body == METRICS, encoding
    _, headers, body = request(server, "/", headers={"Accept-Encoding": "deflate, gzip;q=0.5"})
    assert headers["Content-Encoding"] == "gzip" and gzip.decompress(body).startswith(b"<!DOC")


def test_extra_headers_from_web_config(serve: Callable[..., WebServer]) -> None:
    cfg = parse_web_config("http_server_config: {headers: {X-Frame-Options: deny}}")
    server = serve(web_config=cfg)
    for path in ("/metrics", "/-/healthy", "/nope"):
        assert request(server, path)[1]["X-Frame-Options"] == "deny", path


# --- basic auth --------------------------------------------------------------------------------


def test_basic_auth(serve: Callable[..., WebServer]) -> None:
    cfg = parse_web_config(f"basic_auth_users: {{alice: '{PASSWORD_HASH}'}}")
    server = serve(web_config=cfg)
    for path in ("/metrics", "/api/v1/snapshots", "/", "/nope"):
        status, headers, _ = request(server, path)
        assert status == 401, path
        assert headers["WWW-Authenticate"] == 'Basic realm="kvsidecar"'
    assert request(server, "/metrics", auth="alice:wrong")[0] == 401
    assert request(server, "/metrics", auth="bob:right")[0] == 401
    assert request(server, "/metrics", headers={"Authorization": "Basic !!"})[0] == 401
    assert request(server, "/metrics", auth="alice:right")[0] == 200
    assert request(server, "/api/v1/snapshots", auth="alice:right")[0] == 200
    assert request(server, "/nope", auth="alice:right")[0] == 404
    # Probes carry no credentials.
    assert request(server, "/-/healthy")[0] == 200
    assert request(server, "/-/ready")[0] == 200


# --- TLS ---------------------------------------------------------------------------------------


def test_tls(serve: Callable[..., WebServer], pki: Path) -> None:
    server = serve(web_config=tls_config(pki))
    assert server.tls
    status, _, body = request(server, "/metrics", context=client_context(pki))
    assert (status, body) == (200, METRICS)
    # Plain HTTP to the TLS port is answered at once: 400, as Go exporters do.
    assert request(server, "/metrics", timeout=3)[0] == 400


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
def test_tls_min_version_tls12_refuses_tls11(serve: Callable[..., WebServer], pki: Path) -> None:
    server = serve(web_config=tls_config(pki))
    tls11 = client_context(
        pki, min_version=ssl.TLSVersion.TLSv1, max_version=ssl.TLSVersion.TLSv1_1
    )
    tls11.set_ciphers("DEFAULT:@SECLEVEL=0")  # so the client really offers TLS 1.1
    with pytest.raises(ssl.SSLError, match="PROTOCOL_VERSION"):  # the server's alert
        tls_handshake(server, tls11)
    assert tls_handshake(server, client_context(pki, max_version=ssl.TLSVersion.TLSv1_2)) == (
        "TLSv1.2"
    )
    assert server.stats.snapshot().tls_handshake_errors >= 1


def test_tls_min_version_tls13_refuses_tls12(serve: Callable[..., WebServer], pki: Path) -> None:
    server = serve(web_config=tls_config(pki, "  min_version: TLS13\n"))
    with pytest.raises(ssl.SSLError, match="PROTOCOL_VERSION"):
        tls_handshake(server, client_context(pki, max_version=ssl.TLSVersion.TLSv1_2))
    assert tls_handshake(server, client_context(pki)) == "TLSv1.3"
    assert request(server, "/-/healthy", context=client_context(pki))[0] == 200


def test_mutual_tls(serve: Callable[..., WebServer], pki: Path) -> None:
    mtls = f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki}/ca.crt\n"
    server = serve(web_config=tls_config(pki, mtls + "  client_allowed_sans: [scraper.example]\n"))
    ctx = client_context(pki, client_cert=True)
    assert request(server, "/metrics", context=ctx)[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        request(server, "/metrics", context=client_context(pki))  # no client certificate

    other = serve(web_config=tls_config(pki, mtls + "  client_allowed_sans: [other.example]\n"))
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        request(other, "/metrics", context=ctx)


def test_silent_tls_client_does_not_block_accept(
    serve: Callable[..., WebServer], pki: Path
) -> None:
    # Order, not time: served while the silent client still waits. Were accept blocked on
    # its handshake, the request would be served only once the server gave up on it (10 s).
    server = serve(web_config=tls_config(pki), request_timeout_s=10.0)
    with socket.create_connection(("127.0.0.1", port_of(server))) as silent:  # never says hello
        assert request(server, "/metrics", context=client_context(pki))[0] == 200
        _assert_still_open(silent)


def _assert_still_open(sock: socket.socket) -> None:
    """The server has not closed ``sock`` yet (a closed one reads b"" at once)."""
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(1)
    sock.setblocking(True)


# --- limits and misbehaving clients ------------------------------------------------------------


def test_max_requests_waits_its_turn_then_refuses(
    serve: Callable[..., WebServer], handlers: FakeHandlers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the cap a request waits for a slot (issue 24: keep-alive scrapers holding
    every slot locked a newcomer out with 503s), and 503s only after RENDER_WAIT_S."""
    monkeypatch.setattr(web_server, "RENDER_WAIT_S", 0.5)
    server = serve(max_requests=2)
    handlers.gate = threading.Event()
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(request(server, "/metrics")[0]))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for _ in threads:
        assert handlers.entered.acquire(timeout=5), "both slow requests are being served"
    assert server.stats.snapshot().in_flight == 2
    try:
        status, _, body = request(server, "/metrics")
        assert status == 503 and b"too many" in body, "no slot came within the wait"
        assert request(server, "/-/healthy")[0] == 200, "health is exempt"
        assert request(server, "/-/ready")[0] == 200
        waiter = threading.Thread(target=lambda: results.append(request(server, "/metrics")[0]))
        waiter.start()
        time.sleep(0.1)  # queued behind the two (well within its 0.5 s)
    finally:
        handlers.gate.set()
        for t in threads:
            t.join(5)
    waiter.join(5)
    assert sorted(results) == [200, 200, 200], "the waiting request got the freed slot"
    handlers.gate = None
    assert request(server, "/metrics")[0] == 200, "slots are given back"
    assert server.stats.snapshot().in_flight == 0


def test_max_requests_zero_is_unlimited(
    serve: Callable[..., WebServer], handlers: FakeHandlers
) -> None:
    server = serve(max_requests=0)
    handlers.gate = threading.Event()
    threads = [threading.Thread(target=request, args=(server, "/metrics")) for _ in range(5)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert handlers.entered.acquire(timeout=5)
    finally:
        handlers.gate.set()
        for t in threads:
            t.join(5)


def test_slow_client_does_not_stall_others(serve: Callable[..., WebServer]) -> None:
    server = serve(request_timeout_s=2.0)
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as slow:
        slow.sendall(b"GET /met")  # half a request line, then nothing
        assert request(server, "/metrics")[0] == 200
        # Order, not time: answered while the stalled client is still connected (a stall
        # would have served it only after the server cut the slow one off, 2 s later).
        _assert_still_open(slow)
        # The server gives up on the stalled client; without a deadline the 30 s socket
        # timeout fires instead (15x the 2 s deadline: late timers on a loaded host fit).
        assert slow.recv(1024) == b""


def test_malformed_request_line(serve: Callable[..., WebServer]) -> None:
    server = serve()
    assert raw(server, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(server, b"GET /metrics\r\n\r\n").startswith(b"HTTP/1.1 400 ")  # HTTP/0.9
    assert raw(server, b"GET /metrics HTTP/9.9\r\n\r\n").startswith(b"HTTP/1.1 505 ")
    assert raw(server, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 414 ")
    assert request(server, "/metrics")[0] == 200


def test_huge_headers(serve: Callable[..., WebServer]) -> None:
    server = serve()
    huge = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
    assert raw(server, huge).startswith(b"HTTP/1.1 431 ")
    many = b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150))
    assert raw(server, many + b"\r\n").startswith(b"HTTP/1.1 431 ")
    assert request(server, "/metrics")[0] == 200


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_idle_and_probes_never_take_a_place_under_the_connection_cap(
    serve: Callable[..., WebServer], handlers: FakeHandlers
) -> None:
    """`max_connections` caps connections being served. An idle keep-alive connection
    waits at the gate, not under the cap, and probes are answered at the gate: with the
    one place taken by a render, /-/healthy is answered at once and a second scrape waits
    at the gate for the place (it was closed, or closed another, before the gate)."""
    server = serve(max_connections=1)
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=5) as idle:
        idle.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while METRICS not in answer:
            answer += idle.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")  # kept alive
        assert request(server, "/metrics")[0] == 200, "the idle connection holds no place"
        _assert_still_open(idle)
        assert server.stats.snapshot().rejected_connections == 0
    handlers.gate = threading.Event()
    handlers.entered = threading.Semaphore(0)  # forget the /metrics above
    results: list[int] = []
    busy = [threading.Thread(target=lambda: results.append(request(server, "/metrics")[0]))
            for _ in range(2)]  # fmt: skip
    busy[0].start()
    try:
        assert handlers.entered.acquire(timeout=5)  # the one place is taken
        busy[1].start()
        assert request(server, "/-/healthy")[::2] == (200, b"OK")
        assert request(server, "/-/ready")[0] == 200
        assert not handlers.entered.acquire(timeout=0.5), "the second scrape waits its turn"
    finally:
        handlers.gate.set()
    for t in busy:
        t.join(10)
    assert results == [200, 200]
    assert server.stats.snapshot().rejected_connections == 0


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except (ConnectionError, http.client.HTTPException):
            pass
        time.sleep(0.05)
    return False


def test_rate_limit(serve: Callable[..., WebServer]) -> None:
    server = serve(web_config=parse_web_config("rate_limit: {interval: 1h, burst: 2}"))
    assert [request(server, "/metrics")[0] for _ in range(3)] == [200, 200, 429]
    assert request(server, "/-/healthy")[0] == 200


# --- listening ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (":9400", ("", 9400)),
        ("0.0.0.0:9400", ("0.0.0.0", 9400)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9400", ("::1", 9400)),
        ("[::]:9400", ("::", 9400)),
        ("localhost:65535", ("localhost", 65535)),
    ],
)
def test_parse_listen_address(text: str, parsed: tuple[str, int]) -> None:
    assert parse_listen_address(text) == parsed


@pytest.mark.parametrize("text", ["9400", "localhost", "::1:9400", "[::1]9400", ":http", ":70000"])
def test_parse_listen_address_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid listen address"):
        parse_listen_address(text)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_multiple_listen_addresses(serve: Callable[..., WebServer]) -> None:
    addresses = ["127.0.0.1:0", "127.0.0.1:0"] + (["[::1]:0"] if _has_ipv6_loopback() else [])
    server = serve(tuple(addresses))
    assert len(server.addresses) == len(addresses)
    assert all(a.startswith("127.0.0.1:") for a in server.addresses[:2])
    for i, address in enumerate(server.addresses):
        host = address.rsplit(":", 1)[0].strip("[]")
        conn = http.client.HTTPConnection(host, port_of(server, i), timeout=5)
        conn.request("GET", "/-/healthy")
        assert conn.getresponse().status == 200
        conn.close()
    if len(addresses) == 3:
        assert server.addresses[2].startswith("[::1]:")


def test_all_interfaces(serve: Callable[..., WebServer]) -> None:
    server = serve((":0",))
    assert server.addresses[0].startswith(("[::]:", "0.0.0.0:"))
    assert request(server, "/-/healthy")[0] == 200  # reachable over IPv4 loopback


def test_bind_failure_names_the_address_and_binds_nothing(
    serve: Callable[..., WebServer], handlers: FakeHandlers
) -> None:
    taken = serve()
    clash = WebServer(handlers, ["127.0.0.1:0", taken.addresses[0]])
    with pytest.raises(OSError, match=f"cannot listen on {taken.addresses[0]}"):
        clash.start()
    assert clash.addresses == []


def test_shutdown_stops_listening(handlers: FakeHandlers) -> None:
    with WebServer(handlers, ["127.0.0.1:0"]) as server:
        port = port_of(server)
        assert request(server, "/-/healthy")[0] == 200
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


# --- self-metrics and reload -------------------------------------------------------------------


def test_stats(serve: Callable[..., WebServer]) -> None:
    stats = HTTPStats(buckets=(0.5, 1.0))
    server = serve(stats=stats, max_requests=1)
    request(server, "/metrics")
    request(server, "/metrics")
    request(server, "/nope/with/unbounded/cardinality")
    request(server, "/-/ready", method="POST")
    raw(server, b"GARBAGE\r\n\r\n")
    snap = stats.snapshot()
    assert snap.requests == {
        ("/metrics", "200"): 2,
        ("other", "404"): 1,
        ("other", "405"): 1,
        ("other", "400"): 1,
    }
    hist = snap.durations["/metrics"]
    assert hist.count == 2 and hist.sum >= 0
    assert [le for le, _ in hist.buckets] == [0.5, 1.0, float("inf")]
    assert hist.buckets[-1][1] == 2
    assert snap.in_flight == 0


def test_web_config_reload(serve: Callable[..., WebServer], tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users: {{alice: '{PASSWORD_HASH}'}}\n")
    server = serve(web_config=load_web_config(path), config_check_interval_s=0)
    assert request(server, "/metrics", auth="alice:right")[0] == 200
    assert request(server, "/metrics", auth="bob:right")[0] == 401

    path.write_text(f"basic_auth_users: {{bob: '{PASSWORD_HASH}'}}\n")
    assert request(server, "/metrics", auth="bob:right")[0] == 200
    assert request(server, "/metrics", auth="alice:right")[0] == 401

    path.write_text("basic_auth_users: {carol: not-a-hash}\n")  # broken: keep the last good one
    assert request(server, "/metrics", auth="bob:right")[0] == 200
    assert request(server, "/metrics")[0] == 401


def test_plain_http_to_the_tls_port_gets_400(serve: Callable[..., WebServer], pki: Path) -> None:
    """As Go exporters answer (issue #23): not an empty reply that leaves curl guessing."""
    server = serve(web_config=tls_config(pki))
    for req in (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"HEAD / HTTP/1.0\r\n\r\n"):
        reply = raw(server, req)
        assert reply.startswith(b"HTTP/1.0 400 Bad Request\r\n"), reply
        assert b"Client sent an HTTP request to an HTTPS server." in reply
    assert tls_handshake(server, client_context(pki)) == "TLSv1.3"  # TLS still served
    assert raw(server, b"\x00\x01\x02\x03\x04garbage") == b""  # not HTTP: just closed
