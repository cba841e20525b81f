"""The daemon's own listeners never claim one port twice (issue 44, item 6): a gateway on
the main port's address, or with a rank's port (base + dp_rank) on it, is refused before any
port is bound, in one line naming both flags and the fix (exit 2). Before: "port in use by
another process", sending operators after a process that did not exist."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvsidecar import settings
from kvsidecar.bench.fleet import free_port_run
from kvsidecar.daemon.ports import Claim, overlap


def _serve(shm_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", "serve", "--shm-dir", shm_dir, *args],
        env=settings.without_ours(os.environ), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    "web, gateway, ranks, shared",
    [
        (":{p}", "127.0.0.1:{p}", 1, "{p}"),  # the gateway given the main port
        ("127.0.0.1:{p1}", "127.0.0.1:{p}", 2, "{p1}"),  # its rank 1 lands on the main port
        ("127.0.0.1:{p}", ":{p}", 1, "{p}"),  # a wildcard gateway over a loopback main port
    ],
)
def test_a_gateway_over_the_main_port_is_one_line_naming_both(
    shm_dir: str, web: str, gateway: str, ranks: int, shared: str
) -> None:
    p = free_port_run(2)
    fill = {"p": p, "p1": p + 1}
    proc = _serve(
        shm_dir,
        "--web.listen-address", web.format(**fill),
        "--gateway.listen-address", gateway.format(**fill),
        "--gateway.ranks", str(ranks),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "--web.listen-address" in line and "--gateway.listen-address" in line, line
    assert f"port {shared.format(**fill)}" in line and "give each its own port" in line, line
    assert "in use by another process" not in line


def test_claims() -> None:
    web = Claim("--web.listen-address", ":19440", "", 19440)
    assert overlap([web, Claim("--gateway.listen-address", "x", "::1", 19440)])
    assert overlap([web, Claim("--gateway.listen-address", "x", "127.0.0.1", 19439, 2)])
    assert overlap([web, Claim("--gateway.listen-address", "x", "127.0.0.1", 19441, 4)]) is None
    lo = Claim("--web.listen-address", "127.0.0.1:19440", "127.0.0.1", 19440)
    assert overlap([lo, Claim("--gateway.listen-address", "x", "10.1.1.1", 19440)]) is None
    any_port = Claim("--web.listen-address", ":0", "", 0)
    assert overlap([any_port, Claim("--gateway.listen-address", "x", "", 0, 8)]) is None


def refused_in_one_line(shm_dir: str, *args: str) -> str:
    """`serve` with `args` exits 2 before binding anything, saying why in one line."""
    proc = _serve(shm_dir, *args)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    return line


@pytest.mark.parametrize(
    "flag, other",
    [
        ("--kv-events.endpoint", ("--web.listen-address", "127.0.0.1:{p}")),
        ("--load-push.endpoint", ("--web.listen-address", "127.0.0.1:{p}")),
        ("--load-push.endpoint", ("--kv-events.endpoint", "tcp://127.0.0.1:{p}")),
        ("--load-push.endpoint", ("--gateway.listen-address", "127.0.0.1:{p}")),
    ],
)
def test_a_stream_port_on_another_listener_is_one_line(
    shm_dir: str, flag: str, other: tuple[str, str]
) -> None:
    p = free_port_run(1)
    args = [other[0], other[1].format(p=p)]
    if other[0] != "--web.listen-address":
        args += ["--web.listen-address", "127.0.0.1:0"]
    line = refused_in_one_line(shm_dir, *args, flag, f"tcp://*:{p}")
    assert flag in line and other[0] in line and f"port {p}" in line, line
