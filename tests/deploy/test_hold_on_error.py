"""The crash-looping sidecar case (issue 24 item 7), run: with --hold-on-error (set in
the Kubernetes manifests) a start-up error is logged and the process stays up until
SIGTERM, so the kubelet sees the sidecar running (started, ready) and the engine starts
and stays in its Service; without it the process exits, as before."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXIT_USAGE = 2


def serve(tmp_path: Path, *args: str, hold: bool) -> subprocess.Popen:
    env = {**os.environ, "KVSIDECAR_HOLD_ON_ERROR": "true" if hold else "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvsidecar", "serve", "--shm-dir", str(tmp_path), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def bad_config(tmp_path: Path) -> tuple[str, ...]:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: /nonexistent.crt\n")
    return ("--web.listen-address", "127.0.0.1:0", "--web.config.file", str(web))


@pytest.fixture
def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("case", ["bad web config", "port in use"])
def test_start_error_holds_until_sigterm(
    tmp_path: Path, busy_port: socket.socket, case: str
) -> None:
    port = busy_port.getsockname()[1]
    args = bad_config(tmp_path) if case == "bad web config" else (
        "--web.listen-address", f"127.0.0.1:{port}")  # fmt: skip
    plain = serve(tmp_path, *args, hold=False)
    assert plain.wait(30) == EXIT_USAGE, "without the flag the error exits, as before"
    held = serve(tmp_path, *args, hold=True)
    try:
        # Still up well after the failing start (which takes < 1 s even loaded).
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert held.poll() is None, f"exited with {held.returncode}: {held.stderr.read()}"
            time.sleep(0.2)
        held.send_signal(signal.SIGTERM)
        assert held.wait(30) == EXIT_USAGE
        err = held.stderr.read()
        assert "kvsidecar: " in err and "staying up" in err, err
    finally:
        if held.poll() is None:
            held.kill()
            held.wait()
        busy_port.close()
