"""`kvsidecar serve --web.config.file`: TLS + bcrypt basic auth end to end, with real clients."""

from __future__ import annotations

import base64
import http.client
import shutil
import signal
import ssl
import subprocess
import sys

import bcrypt
import pytest

from kvsidecar.bench.fleet import free_port, start_daemon
from tests.conftest import REPO
from tests.support.certs import make_cert
from tests.support.procs import start_rank, wait_for


def _get(port: int, path: str, ctx: ssl.SSLContext, auth: tuple[str, str] | None = None) -> int:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
    headers = {}
    if auth:
        headers["Authorization"] = (
            "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        )
    conn.request("GET", path, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def test_tls_and_basic_auth_through_serve(shm_dir: str, tmp_path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    make_cert(tmp_path, "tls")
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    (tmp_path / "web.yml").write_text(
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n  min_version: TLS12\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n"
    )
    writer, _ = start_rank("kvsidecar.fake.dp0.tp0.pp0", shm_dir)
    ctx = ssl.create_default_context(cafile=str(tmp_path / "tls.crt"))
    # Up once /-/healthy answers over TLS with that CA.
    daemon, url = start_daemon(
        shm_dir,
        "--web.config.file",
        str(tmp_path / "web.yml"),
        wait_for_source=False,
        timeout=20,
        context=ctx,
        cwd=REPO,
    )
    port = int(url.rsplit(":", 1)[1])
    try:
        assert _get(port, "/-/ready", ctx) == 200  # health endpoints need no credentials
        assert _get(port, "/metrics", ctx) == 401
        assert _get(port, "/metrics", ctx, ("prometheus", "wrong")) == 401
        assert _get(port, "/metrics", ctx, ("prometheus", "s3cret")) == 200
        assert _get(port, "/api/v1/snapshots", ctx, ("prometheus", "s3cret")) == 200
        # Plain HTTP on the TLS port is not served.
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            plain.request("GET", "/metrics")
            status: int | None = plain.getresponse().status
        except (OSError, http.client.HTTPException):
            status = None
        assert status != 200
        # A TLS 1.1 client is refused by the server's minimum.
        old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        old.load_verify_locations(str(tmp_path / "tls.crt"))
        with pytest.warns(DeprecationWarning):  # Python itself frowns on TLS 1.1
            old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
        with pytest.raises((ssl.SSLError, OSError)):
            _get(port, "/-/healthy", old)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)
        writer.kill()
        writer.wait()


def _status(port: int, path: str, auth: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        conn.request("GET", path, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def test_sighup_reloads_the_web_config_and_keeps_serving(shm_dir: str, tmp_path) -> None:
    """SIGHUP's default action kills a process (and Restart=on-failure does not bring it
    back): the daemon must re-read --web.config.file and keep serving instead."""
    web = tmp_path / "web.yml"
    alice = bcrypt.hashpw(b"a-pass", bcrypt.gensalt(rounds=4)).decode()
    bob = bcrypt.hashpw(b"b-pass", bcrypt.gensalt(rounds=4)).decode()
    web.write_text(f"basic_auth_users:\n  alice: '{alice}'\n")
    log = tmp_path / "daemon.log"
    port = free_port()
    with open(log, "w") as err:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar", "serve", "--shm-dir", shm_dir,
             "--web.listen-address", f"127.0.0.1:{port}", "--web.config.file", str(web)],
            cwd=REPO, stderr=err,
        )  # fmt: skip
    try:

        def healthy() -> bool:
            try:
                return _status(port, "/-/healthy") == 200
            except OSError:
                return False

        assert wait_for(healthy, timeout=20)
        assert _status(port, "/metrics", "alice:a-pass") == 200
        daemon.send_signal(signal.SIGHUP)  # nothing changed: reload, keep serving
        assert wait_for(lambda: "reloaded web config" in log.read_text(), timeout=10)
        assert daemon.poll() is None, "SIGHUP killed the daemon"
        assert _status(port, "/metrics", "alice:a-pass") == 200

        web.write_text("basic_auth_users: {carol: not-a-hash}\n")  # broken: keep the old
        daemon.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "invalid, keeping the previous one" in log.read_text(), 10)
        assert daemon.poll() is None and _status(port, "/metrics", "alice:a-pass") == 200

        web.write_text(f"basic_auth_users:\n  bob: '{bob}'\n")
        daemon.send_signal(signal.SIGHUP)
        assert wait_for(lambda: _status(port, "/metrics", "bob:b-pass") == 200, timeout=10)
        assert _status(port, "/metrics", "alice:a-pass") == 401
        assert daemon.poll() is None
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)
    assert daemon.returncode == 0
