"""TLS and client certificates on the gateway listeners (issue 44, item 5): a picker's
`metrics-data-source` polls `https` with a CA and a client certificate. Before: the gateway
spoke plain HTTP only (`--gateway.web-config-file` did not exist; a TLS client's hello was read
as a bad request line). Real certificates (openssl CLI), a real daemon and real writer
processes, Python's ssl as the client."""

from __future__ import annotations

import contextlib
import http.client
import shutil
import signal
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.web.config import WebConfigError
from kvsidecar.web.config_file import load_web_config
from kvsidecar.web.poll_server import PollServer
from kvsidecar.web.poll_tls import PollTLS
from kvsidecar.web.sockets import bind
from tests.daemon.test_gateway import daemon_with_gateway, start_writer, stop, stop_daemon
from tests.support.certs import make_cert
from tests.support.procs import wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI")


def _web_yml(d: Path, client: bool) -> Path:
    text = "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
    if client:
        text += "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: picker.crt\n"
    (d / "gateway-web.yml").write_text(text)
    return d / "gateway-web.yml"


def _client(d: Path, cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(d / "server.crt"))
    if cert:
        ctx.load_cert_chain(str(d / "picker.crt"), str(d / "picker.key"))
    return ctx


@contextlib.contextmanager
def _serving(shm_dir: str, cfg: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """A writer on dp_rank 0 and a daemon serving it on a TLS gateway; both stopped after,
    whatever failed (a daemon that did not start leaves no writer behind)."""
    writer = start_writer("kvsidecar.gwtls.dp0", shm_dir)
    daemon = None
    try:
        daemon, _url, port = daemon_with_gateway(shm_dir, "--gateway.web-config-file", str(cfg))
        yield daemon, port
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        stop(writer)


def _get(port: int, ctx: ssl.SSLContext) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("localhost", port, context=ctx, timeout=30)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_https_poll_with_client_certificate_through_serve(shm_dir: str, tmp_path: Path) -> None:
    make_cert(tmp_path, "server")
    make_cert(tmp_path, "picker")  # self-signed: its own CA
    cfg = _web_yml(tmp_path, client=True)
    with _serving(shm_dir, cfg) as (_daemon, port):
        ok = _client(tmp_path, cert=True)
        assert wait_for(lambda: _get(port, ok)[0] == 200)
        status, body = _get(port, ok)
        assert status == 200 and b"vllm:kv_cache_usage_perc" in body
        # Verified against the CA: the client refuses a server it cannot verify ...
        with pytest.raises(ssl.SSLCertVerificationError):
            _get(port, ssl.create_default_context())
        # ... and the server refuses a client without a certificate.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _get(port, _client(tmp_path, cert=False))
        # Plain HTTP on the TLS port is not answered as a poll.
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/metrics")
            status = conn.getresponse().status
            assert status != 200
            raise ConnectionError("answered")
        # The refused ones cost the next poll nothing (a wait: on a loaded host the writer
        # itself can miss --gateway.stale-after for a moment, a 503 that is not the TLS's).
        assert wait_for(lambda: _get(port, ok)[0] == 200)


@pytest.mark.parametrize("how", ["sighup", "change"])
def test_a_changed_certificate_is_served_after_reload(
    shm_dir: str, tmp_path: Path, how: str
) -> None:
    """Rotated in place (as a Kubernetes secret update does): new connections get the new
    certificate, on SIGHUP or, without a signal, once the change is seen (checked once a
    second), without a restart."""
    make_cert(tmp_path, "server")
    cfg = _web_yml(tmp_path, client=False)
    with _serving(shm_dir, cfg) as (daemon, port):
        first = (tmp_path / "server.crt").read_bytes()
        old_ctx = _client(tmp_path, cert=False)
        assert wait_for(lambda: _get(port, old_ctx)[0] == 200)
        new_dir = tmp_path / "new"
        new_dir.mkdir()
        make_cert(new_dir, "server")
        for name in ("server.crt", "server.key"):
            (tmp_path / name).write_bytes((new_dir / name).read_bytes())
        assert (tmp_path / "server.crt").read_bytes() != first
        if how == "sighup":
            daemon.send_signal(signal.SIGHUP)
        new_ctx = _client(tmp_path, cert=False)

        def new_served() -> bool:
            try:
                return _get(port, new_ctx)[0] == 200
            except ssl.SSLError:
                return False

        assert wait_for(new_served)
        with pytest.raises(ssl.SSLCertVerificationError):
            _get(port, old_ctx)  # the old certificate is no longer served


def test_the_gateway_file_holds_only_tls(tmp_path: Path) -> None:
    """basic_auth_users there would read as a protection the gateway does not give."""
    make_cert(tmp_path, "server")
    p = tmp_path / "web.yml"
    p.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "basic_auth_users:\n  x: '$2b$04$" + "a" * 53 + "'\n"
    )
    with pytest.raises(WebConfigError, match="reads only tls_server_config, not basic_auth"):
        PollTLS.load(str(p))
    p.write_text("rate_limit:\n  interval: 1s\n  burst: 1\n")
    with pytest.raises(WebConfigError):
        PollTLS.load(str(p))


def test_a_reload_to_a_file_with_basic_auth_keeps_the_last_good_one(tmp_path: Path) -> None:
    make_cert(tmp_path, "server")
    cfg = _web_yml(tmp_path, client=False)
    tls = PollTLS.load(str(cfg))
    before = tls.live.peek()
    cfg.write_text(cfg.read_text() + "basic_auth_users:\n  x: '$2b$04$" + "a" * 53 + "'\n")
    assert tls.reload() is False
    assert tls.live.peek() is before  # still TLS, never read as basic auth it won't check


def test_an_unfinished_handshake_is_closed_and_the_budget_holds(tmp_path: Path) -> None:
    """A client that connects and sends nothing (or half a hello) holds a place only until
    the head deadline, and the budget's eviction still makes room for a picker."""
    make_cert(tmp_path, "server")
    tls = PollTLS(load_web_config(_web_yml(tmp_path, client=False)))
    body = b"ok\n"
    server = PollServer(
        [(bind("127.0.0.1", 0), lambda path: (200, body, "text/plain", b""))],
        max_connections=4,
        head_timeout=0.5,
        tls=tls,
    )
    server.start()
    port = int(server.addresses[0].rsplit(":", 1)[1])
    idle = []
    try:
        for _ in range(8):  # more than the budget, none finishing a handshake
            s = socket.create_connection(("127.0.0.1", port))
            s.send(b"\x16\x03\x01")  # the start of a TLS record, never finished
            idle.append(s)
        ctx = _client(tmp_path, cert=False)
        assert _get(port, ctx) == (200, body)
        assert server.connections <= 4
        assert wait_for(lambda: server.closed.get("slow_head", 0) >= 1)
        assert wait_for(lambda: any(_closed(s) for s in idle))
    finally:
        for s in idle:
            s.close()
        server.shutdown()


def _closed(s: socket.socket) -> bool:
    """The server has closed `s` (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(64) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
