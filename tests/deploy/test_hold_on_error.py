"""The crash-looping sidecar case (issue 24 item 7), run: with --hold-on-error (set in
the Kubernetes manifests) a start-up error is logged and the process stays up until
SIGTERM, so the kubelet sees the sidecar running (started, ready) and the engine starts
and stays in its Service; without it the process exits, as before."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import wait_for
from tests.test_operator_cli import _healthy

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
        assert "level=ERROR" in err and "staying up" in err, err
    finally:
        if held.poll() is None:
            held.kill()
            held.wait()
        busy_port.close()


@pytest.mark.parametrize("hold", [False, True])
def test_start_errors_honor_the_log_format(
    tmp_path: Path, busy_port: socket.socket, hold: bool
) -> None:
    """Issue 33 item 2: with --log.format json every line on stderr is JSON, the start-up
    error and the hold notice included (they were plain `kvsidecar: ...` lines)."""
    port = busy_port.getsockname()[1]
    args = ("--web.listen-address", f"127.0.0.1:{port}", "--log.format", "json")
    proc = serve(tmp_path, *args, hold=hold)
    try:
        if hold:
            lines: list[str] = []
            assert wait_for(
                lambda: lines.append(proc.stderr.readline()) or "staying up" in lines[-1],
                timeout=60,
            ), lines
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == EXIT_USAGE
        err = (("".join(lines)) if hold else "") + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        busy_port.close()
    records = [json.loads(ln) for ln in err.splitlines() if ln.strip()]
    errors = [r for r in records if r["level"] == "ERROR"]
    assert errors and "port in use by another process" in errors[0]["msg"], err
    assert any("staying up" in r["msg"] for r in records) == hold, err


# write(2)'s syscall number: /proc/PID/syscall shows it while the process blocks in it.
WRITE_SYSCALL = {"x86_64": "1", "aarch64": "64"}


def test_sigterm_during_start_is_not_lost(tmp_path: Path, busy_port: socket.socket) -> None:
    """A SIGTERM that arrives while start-up is still going, before the start error, stops
    the held process too: it exits with the error's code instead of waiting for a second
    SIGTERM that the kubelet will not send. The start is held at a known point by handing
    the daemon a full stderr pipe: it blocks writing the "cannot listen" error."""
    import platform

    write_nr = WRITE_SYSCALL.get(platform.machine())
    if write_nr is None:
        pytest.skip(f"write(2)'s syscall number on {platform.machine()} is not listed here")
    port = busy_port.getsockname()[1]
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)  # fill the pipe: the daemon's first stderr write blocks
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    env = {**os.environ, "KVSIDECAR_HOLD_ON_ERROR": "true"}
    argv = [sys.executable, "-m", "kvsidecar", "serve", "--shm-dir", str(tmp_path)]
    held = subprocess.Popen(
        [*argv, "--web.listen-address", f"127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=w,
    )
    os.close(w)
    try:
        deadline = time.monotonic() + 60
        while Path(f"/proc/{held.pid}/syscall").read_text().split()[:2] != [write_nr, "0x2"]:
            assert held.poll() is None, f"exited with {held.returncode} before writing"
            assert time.monotonic() < deadline, "never blocked writing its start error"
            time.sleep(0.05)
        held.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the handler runs now, inside the interrupted write
        # Drain to EOF (every writer gone), but no longer than 30 s: a daemon that waits for
        # a second SIGTERM keeps its end of the pipe open.
        drained = b""
        os.set_blocking(r, False)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                chunk = os.read(r, 65536)
            except BlockingIOError:
                time.sleep(0.05)
                continue
            if not chunk:
                break
            drained += chunk
        try:
            code = held.wait(5)  # its stderr closed at exit: it is gone or about to be
        except subprocess.TimeoutExpired:
            code = None
        assert code == EXIT_USAGE, (
            f"still up 30 s after a SIGTERM received during start-up (returncode {code}): "
            "it waits for a second one"
        )
        err = drained.decode(errors="replace").replace("x", "")
        assert "cannot listen" in err and "staying up" not in err, err[-500:]
    finally:
        if held.poll() is None:
            held.kill()
            held.wait()
        os.close(r)
        busy_port.close()


def _held(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "stderr.log"
    env = {**os.environ, "KVSIDECAR_HOLD_ON_ERROR": "true"}
    argv = [sys.executable, "-m", "kvsidecar", "serve", "--shm-dir", str(tmp_path), *args]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return proc, log


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_held_start_retries_until_the_port_is_free(tmp_path: Path) -> None:
    """Issue 31 item 10: a port squatted for a few seconds at start left the held daemon
    up and serving nothing for ever on bca725e. Now it retries, with back-off, in place
    (the same pid)."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    proc, log = _held(tmp_path, "--web.listen-address", f"127.0.0.1:{port}")
    try:
        assert wait_for(lambda: "staying up" in log.read_text(), timeout=60), log.read_text()
        squatter.close()
        assert wait_for(lambda: _healthy(port), timeout=120), log.read_text()
        assert proc.poll() is None
        assert "retrying in" in log.read_text()
    finally:
        squatter.close()
        assert _stop(proc) == 0, log.read_text()


def test_a_fixed_web_config_is_picked_up_while_holding(tmp_path: Path) -> None:
    """The web config fixed, then SIGHUP (as after a ConfigMap update): bca725e ignored
    both while holding. The retry also comes on its own, after the back-off."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: /nonexistent.crt\n")
    args = ("--web.listen-address", f"127.0.0.1:{port}", "--web.config.file", str(web))
    proc, log = _held(tmp_path, *args)
    try:
        assert wait_for(lambda: "staying up" in log.read_text(), timeout=60), log.read_text()
        web.write_text("{}\n")  # no TLS, no auth: valid
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: _healthy(port), timeout=120), log.read_text()
        assert proc.poll() is None
    finally:
        assert _stop(proc) == 0, log.read_text()
