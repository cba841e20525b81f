"""Exporter conventions of `kvsidecar serve` (issue 33 item 10), run as real processes: a
warning when run as root (suppressible), --help-man, --version with its build date, and
systemd socket activation (--web.systemd-socket); plus a missing --shm-dir logged in
--log.format like every start-up error."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvsidecar import settings
from kvsidecar.bench.fleet import stop_daemon
from tests.conftest import REPO
from tests.support.procs import wait_for

KVSIDECAR = [sys.executable, "-m", "kvsidecar"]
ROOT_WARNING = "running as root"


def _env(**extra: str) -> dict[str, str]:
    return {**settings.without_ours(os.environ), **extra}


def _serve_lines(shm_dir: str, *args: str, env: dict[str, str]) -> list[dict]:
    """Start serve, wait until it serves, stop it; its stderr lines as JSON objects."""
    proc = subprocess.Popen(
        [*KVSIDECAR, "serve", "--shm-dir", shm_dir, "--web.listen-address", "127.0.0.1:0",
         "--log.format", "json", *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if "serving /metrics" in line:
            break
    stop_daemon(proc)
    lines += proc.stderr.readlines()
    return [json.loads(x) for x in lines]  # every line through the logger


@pytest.mark.skipif(os.geteuid() != 0, reason="the warning is about running as root")
def test_root_warns_once_in_the_log_format_unless_root_is_intended(shm_dir: str) -> None:
    records = _serve_lines(shm_dir, env=_env())
    warned = [r for r in records if ROOT_WARNING in r["msg"]]
    assert len(warned) == 1 and warned[0]["level"] == "WARN", records
    assert "--allow-root" in warned[0]["msg"] and settings.ALLOW_ROOT.name in warned[0]["msg"]
    for how in (("--allow-root",), ()):
        env = _env() if how else _env(**{settings.ALLOW_ROOT.name: "1"})
        records = _serve_lines(shm_dir, *how, env=env)
        assert not [r for r in records if ROOT_WARNING in r["msg"]], (how, records)
        assert any("serving /metrics" in r["msg"] for r in records)


@pytest.mark.skipif(os.geteuid() == 0, reason="as root it warns (the test above)")
def test_no_root_warning_for_another_user(shm_dir: str) -> None:
    records = _serve_lines(shm_dir, env=_env())
    assert not [r for r in records if ROOT_WARNING in r["msg"]], records


@pytest.mark.parametrize(
    "why, args",
    [
        ("web port in use", ("--web.listen-address", "127.0.0.1:{busy}")),
        ("gateway port in use", ("--gateway.listen-address", "127.0.0.1:{busy}")),
        ("bad web config", ("--web.config.file", "/nonexistent/web.yml")),
        ("bad OTLP endpoint", ("--otlp.endpoint", "collector:4318")),
    ],
)
def test_a_start_up_error_is_the_only_line_even_as_root(
    shm_dir: str, why: str, args: tuple[str, ...]
) -> None:
    """The root warning comes only once serving is sure: before, as root (CI, a root
    container), it came first and every start-up error was two lines, the fix in the second
    (CI of 49b8c26: the OTLP one-line tests failed as root, as they would for a user)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [a.format(busy=port) for a in args]
        proc = subprocess.run(
            [*KVSIDECAR, "serve", "--shm-dir", shm_dir, "--web.listen-address", "127.0.0.1:0",
             "--log.format", "json", *argv],
            env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2, (why, proc.stderr)
    (line,) = proc.stderr.splitlines()
    assert json.loads(line)["level"] == "ERROR", line


def test_missing_shm_dir_is_logged_in_the_log_format(tmp_path: Path) -> None:
    """Issue 33 item 2 routed the other start-up errors through the logger; the missing
    directory still printed a plain `kvsidecar: ...` line."""
    proc = subprocess.run(
        [*KVSIDECAR, "serve", "--shm-dir", str(tmp_path / "missing"), "--log.format", "json",
         "--web.listen-address", "127.0.0.1:0"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()  # no root warning before it: still one line
    record = json.loads(line)
    assert record["level"] == "ERROR" and "does not exist" in record["msg"], record
    assert "--shm-dir" in record["msg"]


def test_help_man_is_a_clean_man_page() -> None:
    groff = shutil.which("groff")
    for args, title in (([], "KVSIDECAR"), (["serve"], "KVSIDECAR-SERVE")):
        proc = subprocess.run([*KVSIDECAR, *args, "--help-man"], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        page = proc.stdout
        assert page.startswith(f'.TH "{title}" 1 '), page[:200]
        for section in ("NAME", "SYNOPSIS", "OPTIONS", "ENVIRONMENT", "EXIT STATUS"):
            assert f"\n.SH {section}\n" in page, section
        # Every serve option and its variable, as --help has them.
        for flag in ("--web.systemd-socket", "--allow-root", "--web.listen-address"):
            assert flag.replace("-", "\\-") in page, flag
        assert settings.WEB_SYSTEMD_SOCKET.name in page
        if groff:  # -ww: every warning; -z: no output, only the diagnostics
            lint = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z"], input=page,
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            assert lint.returncode == 0 and not lint.stderr, lint.stderr
    whole = subprocess.run([*KVSIDECAR, "--help-man"], capture_output=True, text=True,
                           timeout=60).stdout  # fmt: skip
    assert "\n.SH COMMANDS\n" in whole and "kvsidecar dump" in whole


def test_version_has_the_build_date() -> None:
    proc = subprocess.run([*KVSIDECAR, "serve", "--version"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0
    date = re.search(r"^  build date: +(\S+)$", proc.stdout, re.M)
    assert date, proc.stdout
    commit = subprocess.run(
        ["git", "log", "-1", "--date=format-local:%Y%m%d-%H:%M:%S", "--format=%cd"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "TZ": "UTC"},
    ).stdout.strip()  # fmt: skip
    assert date.group(1) == commit, (proc.stdout, commit)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


# What systemd does between fork and exec: the socket onto descriptor 3, LISTEN_FDS=1 and
# LISTEN_PID=the pid that will run serve (the exec keeps it; `sh -c 'LISTEN_PID=$$ exec ..'`
# would do too, but dash moves only descriptors 0-9).
_EXEC_WRAPPER = r"""
import os, sys
fd, pid = int(sys.argv[1]), sys.argv[2]
os.dup2(fd, 3)
os.close(fd)
os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()) if pid == "self" else pid)
os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
"""


def _activated(
    sock: socket.socket, shm_dir: str, *args: str, pid: str = "self"
) -> subprocess.Popen:
    """serve as systemd starts it, with `sock` passed (see _EXEC_WRAPPER)."""
    fd = sock.fileno()
    serve = [*KVSIDECAR[1:], "serve", "--shm-dir", shm_dir, "--log.format", "json", *args]
    return subprocess.Popen(
        [sys.executable, "-c", _EXEC_WRAPPER, str(fd), pid, *serve],
        pass_fds=(fd,), env=_env(**{settings.ALLOW_ROOT.name: "1"}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_systemd_socket_activation_serves_the_passed_socket(shm_dir: str) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    # --web.listen-address is ignored: the passed sockets replace it (exporter-toolkit).
    proc = _activated(sock, shm_dir, "--web.systemd-socket", "--web.listen-address", ":1")
    sock.close()  # the daemon holds its own copy
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _healthy(url), 30), "the passed socket is not served"
        assert _get(f"{url}/metrics") == 200
    finally:
        stop_daemon(proc)
    assert proc.stderr is not None
    records = [json.loads(x) for x in proc.stderr.read().splitlines()]
    assert any(f"listening on http://127.0.0.1:{port}" in r["msg"] for r in records), records
    assert proc.returncode == 0


@pytest.mark.parametrize("case", ["no LISTEN_FDS", "another pid"])
def test_systemd_socket_errors_are_one_log_line(shm_dir: str, case: str) -> None:
    if case == "no LISTEN_FDS":
        proc = subprocess.run(
            [*KVSIDECAR, "serve", "--shm-dir", shm_dir, "--web.systemd-socket",
             "--log.format", "json", "--allow-root"],
            env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        rc, err = proc.returncode, proc.stderr
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with sock:
            child = _activated(sock, shm_dir, "--web.systemd-socket", pid="1")
            rc, err = child.wait(60), child.stderr.read()  # type: ignore[union-attr]
    assert rc == 2, err
    (line,) = err.splitlines()
    record = json.loads(line)
    assert record["level"] == "ERROR" and "--web.systemd-socket" in record["msg"], record
    expected = "LISTEN_PID/LISTEN_FDS unset" if case == "no LISTEN_FDS" else "not this process"
    assert expected in record["msg"], record


def _healthy(url: str) -> bool:
    try:
        return _get(f"{url}/-/healthy") == 200
    except OSError:
        return False
