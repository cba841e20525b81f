"""`kvsidecar serve --otlp.*` over TLS to a real HTTPS receiver on loopback (self-signed
certificates from the openssl CLI): the push works with the CA file and the token from a
headers file reaches the receiver; without the CA it fails with one log line naming
--otlp.ca-file; a receiver that requires a client certificate gets one from
--otlp.cert-file/--otlp.key-file."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs kvsidecar[otlp]")
if shutil.which("openssl") is None:
    pytest.skip("needs the openssl CLI", allow_module_level=True)

from tests.support.certs import make_cert
from tests.support.otlp_receiver import start_receiver
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch, value

WAIT_S = 120.0  # an "eventually", not a speed bound
TOKEN = "Bearer s3cret-token-from-a-file"


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    server_cert, server_key = make_cert(tmp_path, "server")
    client_cert, client_key = make_cert(tmp_path, "client")
    headers = tmp_path / "otlp-headers"
    headers.write_text(f"# the collector's token\nAuthorization: {TOKEN}\n")
    headers.chmod(0o600)
    return {
        "server_cert": server_cert,
        "server_key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
        "headers": headers,
    }


def _tls(certs: dict[str, Path], client_ca: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs["server_cert"], certs["server_key"])
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca)
    return ctx


def _serve(
    shm_dir: str, port: int, err: Path, *extra: str, **popen: Any
) -> tuple[subprocess.Popen, str]:
    endpoint = f"https://127.0.0.1:{port}/v1/metrics"
    with open(err, "w") as f:
        return start_daemon(
            shm_dir,
            *("--log-level", "info", "--otlp.endpoint", endpoint, "--otlp.interval", "0.3"),
            *extra,
            stderr=f,
            **popen,
        )


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def _failed(url: str) -> float:
    text = fetch(url + "/metrics")[2]
    return value(text, "kvsidecar_otlp_dropped_batches_total", reason="send_failed") or 0.0


def test_tls_with_ca_and_token(
    shm_dir: str, rank: None, certs: dict[str, Path], tmp_path: Path
) -> None:
    srv, got = start_receiver(tls=_tls(certs))
    err = tmp_path / "serve.err"
    args = (
        "--otlp.ca-file",
        str(certs["server_cert"]),
        "--otlp.headers-file",
        str(certs["headers"]),
    )
    # An image's own CA bundle in the environment: requests would let it override the
    # session's CA file, and the push failed however --otlp.ca-file was given.
    env = {**os.environ, "REQUESTS_CA_BUNDLE": str(certs["client_cert"])}
    proc, url = _serve(shm_dir, srv.server_address[1], err, *args, env=env)
    try:
        assert wait_for(lambda: len(got) >= 2, WAIT_S)
        assert {h["authorization"] for h in srv.headers} == {TOKEN}
        assert any(len(r.resource_metrics) > 1 for r in got)  # the rank's Resource too
        assert _failed(url) == 0
    finally:
        _stop(proc)
        srv.shutdown()
    text = err.read_text()
    assert TOKEN not in text  # never logged
    # One line when the push starts, one when the collector first takes a batch (issue 45).
    started = [ln for ln in text.splitlines() if "OTLP push to https://" in ln and "every" in ln]
    assert len(started) == 1 and "every 0.3 s (cumulative" in started[0], text
    first = [ln for ln in text.splitlines() if "first batch accepted" in ln]
    assert len(first) == 1 and "resources" in first[0], text


def test_tls_without_ca_fails_in_one_line(
    shm_dir: str, rank: None, certs: dict[str, Path], tmp_path: Path
) -> None:
    srv, got = start_receiver(tls=_tls(certs))
    err = tmp_path / "serve.err"
    proc, url = _serve(shm_dir, srv.server_address[1], err)
    try:
        assert wait_for(lambda: _failed(url) >= 3, WAIT_S)  # several pushes, each refused
    finally:
        _stop(proc)
        srv.shutdown()
    assert not got
    text = err.read_text()
    lines = [ln for ln in text.splitlines() if "failing" in ln or "Traceback" in ln]
    assert len(lines) == 1, lines  # once, not once per push
    assert "first batch accepted" not in text
    assert "TLS certificate not trusted" in lines[0] and "--otlp.ca-file" in lines[0], lines


def test_client_certificate(
    shm_dir: str, rank: None, certs: dict[str, Path], tmp_path: Path
) -> None:
    srv, got = start_receiver(tls=_tls(certs, client_ca=certs["client_cert"]))
    err = tmp_path / "serve.err"
    args = (
        *("--otlp.ca-file", str(certs["server_cert"])),
        *("--otlp.cert-file", str(certs["client_cert"])),
        *("--otlp.key-file", str(certs["client_key"])),
    )
    proc, url = _serve(shm_dir, srv.server_address[1], err, *args)
    try:
        # The receiver requires a certificate its CA signed: a push that lands carried it.
        assert wait_for(lambda: len(got) >= 1, WAIT_S)
        assert _failed(url) == 0
    finally:
        _stop(proc)
        srv.shutdown()
