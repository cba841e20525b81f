"""``kvsidecar bench frontshapes``: the attack shapes of issue 31 items 3-7 against a real
``kvsidecar serve``, one fresh daemon per shape, each reported as what a kubelet or a
scraper would see. Run it twice, the second time with KVSIDECAR_BENCH_CHECKOUT=<older
tree>, for the side-by-side table of docs/reliability.md.

- ``busy``: 420 client addresses, one keep-alive connection each, re-sending a distinct
  wrong password at once (basic auth on, bcrypt cost 10); unauthenticated ``/-/healthy``
  probes (they need none) from the prober's address.
- ``slowreaders``: 1,200 connections from the prober's own address (a kubelet shares the
  node's address with every hostNetwork pod) each sending 256 ``/metrics`` requests and
  never reading; plain ``/-/healthy`` probes.
- ``tlshellos``: TLS on (RSA-4096), 64 addresses (the prober's among them) each sending
  ClientHellos with a fresh random, half of the clients hanging up at once, half staying
  silent; TLS ``/-/healthy`` probes, a fresh connection each. ``tlshellos-p256``: the
  same with an ECDSA P-256 certificate (a signature ~100x cheaper).
- ``trickle``: 1,000 connections each sending a byte of a request head every 5 s.
- ``authflood``: 64 addresses each opening a new connection per distinct wrong password;
  a valid login (a new connection) from the prober's address, timed.

Probes wait at most 1 s, a kubelet's default ``timeoutSeconds``; the goal is 95 %
answered (and a login within 1 s, and ``/-/healthy`` p99 < 100 ms under the trickle).
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import bcrypt

from kvsidecar import settings
from kvsidecar.bench.fleet import proc_stat
from tests.attacks.hostile_clients import (
    Tricklers,
    _daemon,
    _probe,
    _raise_nofile,
    _self_signed,
    _summary,
)
from tests.attacks.hostile_front import SlowReaders, rsa_self_signed, web_config_for

__all__ = ["SHAPES", "run_frontshapes"]

PROBE_TIMEOUT_S = 1.0  # a kubelet's default timeoutSeconds
GOAL_ANSWERED = 0.95
GOAL_LOGIN_MS = 1000.0
PROBER = "127.0.0.1"
_TRICKLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000


def _address(group: int, k: int) -> str:
    """The k-th attacker address of a group: 127.<group>.<k // 250>.<k % 250 + 1>."""
    return f"127.{group}.{k // 250}.{k % 250 + 1}"


class _Threads:
    """``n`` attacker threads running ``body(k, stop)``; stopped and joined on exit."""

    def __init__(self, n: int, body: Callable[[int, threading.Event], None]) -> None:
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=body, args=(k, self.stop), daemon=True) for k in range(n)
        ]

    def __enter__(self) -> _Threads:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)


def _basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


@contextlib.contextmanager
def _auth_daemon(tmp: str) -> Iterator[tuple[Any, int]]:
    pw_hash = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(10)).decode()
    path = os.path.join(tmp, "web.yml")
    with open(path, "w") as f:
        f.write(f"basic_auth_users: {{alice: '{pw_hash}'}}\n")
    with _daemon(path) as (daemon, url):
        yield daemon, int(url.rsplit(":", 1)[1])


def _wrong_password(k: int, n: int, connection: str = "") -> bytes:
    """Attacker ``k``'s ``n``-th request, with a distinct wrong password."""
    token = _basic("alice", f"wrong-{k}-{n}")
    return (
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n{connection}\r\n"
    ).encode()


def _wrong_passwords_kept_alive(port: int, k: int, stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), 10, (_address(1, k), 0)) as s:
                while not stop.is_set():
                    n += 1
                    s.sendall(_wrong_password(k, n))
                    if not s.recv(4096):
                        break
        except OSError:
            stop.wait(0.05)


def _wrong_passwords_reconnecting(port: int, k: int, stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        try:
            with socket.create_connection(("127.0.0.1", port), 10, (_address(3, k), 0)) as s:
                s.sendall(_wrong_password(k, n, "Connection: close\r\n"))
                s.recv(4096)
        except OSError:
            stop.wait(0.05)


def _fresh_hellos(port: int, ctx: ssl.SSLContext, k: int, stop: threading.Event) -> None:
    source = PROBER if k == 0 else _address(2, k)
    held: list[socket.socket] = []
    n = 0
    while not stop.is_set():
        n += 1
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
        with contextlib.suppress(ssl.SSLWantReadError):
            obj.do_handshake()  # a fresh random in every hello
        try:
            s = socket.create_connection(("127.0.0.1", port), 5, (source, 0))
            s.sendall(outgoing.read())
        except OSError:
            stop.wait(0.05)
            continue
        if n % 2:
            s.close()  # hung up at once: its queued handshake is for nobody
        else:
            held.append(s)  # silent, never reads the server's flight
            if len(held) > 8:
                held.pop(0).close()
        stop.wait(0.01)
    for s in held:
        s.close()


def _probes(port: int, seconds: float, ctx: ssl.SSLContext | None = None) -> dict[str, Any]:
    samples = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples.append(_probe(port, "/-/healthy", ctx, timeout=PROBE_TIMEOUT_S))
        time.sleep(0.1)
    summary = _summary(samples)
    summary["answered"] = summary["ok"] / max(1, summary["requests"])
    return summary


def _logins(port: int, seconds: float) -> dict[str, Any]:
    times, statuses = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ok, took = _probe(port, "/metrics", None, timeout=10.0, auth="alice:s3cret")
        statuses.append(ok)
        times.append(took * 1e3)
        time.sleep(0.5)
    return {
        "logins": len(times),
        "ok": sum(statuses),
        "median_ms": sorted(times)[len(times) // 2] if times else float("nan"),
        "max_ms": max(times) if times else float("nan"),
    }


def _measured(daemon: Any, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    cpu0, t0 = proc_stat(daemon.pid)[1], time.monotonic()
    result = run()
    rss, cpu1 = proc_stat(daemon.pid)
    result["daemon_cpu_pct"] = 100 * (cpu1 - cpu0) / (time.monotonic() - t0)
    result["daemon_rss_mb"] = rss / 2**20
    return result


def _under_wrong_passwords(
    n: int,
    attacker: Callable[[int, int, threading.Event], None],
    measure: Callable[[int], dict[str, Any]],
) -> dict[str, Any]:
    """``measure(port)`` of a daemon with basic auth on while ``n`` threads run
    ``attacker(port, k, stop)`` (shapes 3 and 7)."""
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        with _auth_daemon(tmp) as (daemon, port):
            with _Threads(n, lambda k, stop: attacker(port, k, stop)):
                time.sleep(2.0)
                return _measured(daemon, lambda: measure(port))


def shape_busy(seconds: float, n: int = 420) -> dict[str, Any]:
    return _under_wrong_passwords(
        n, _wrong_passwords_kept_alive, lambda port: _probes(port, seconds)
    )


def shape_slowreaders(seconds: float, n: int = 1200) -> dict[str, Any]:
    with _daemon() as (daemon, url):
        port = int(url.rsplit(":", 1)[1])
        attack = SlowReaders(port, n, source=PROBER).start()
        try:
            time.sleep(3.0)
            return _measured(daemon, lambda: _probes(port, seconds))
        finally:
            attack.stop()


def shape_tlshellos(seconds: float, n: int = 64, ecdsa: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        cert, key = _self_signed(tmp) if ecdsa else rsa_self_signed(tmp)
        ctx = ssl.create_default_context(cafile=cert)
        with _daemon(web_config_for(tmp, cert, key), ctx) as (daemon, url):
            port = int(url.rsplit(":", 1)[1])
            with _Threads(n, lambda k, stop: _fresh_hellos(port, ctx, k, stop)):
                time.sleep(2.0)
                return _measured(daemon, lambda: _probes(port, seconds, ctx))


def shape_trickle(seconds: float, n: int = 1000) -> dict[str, Any]:
    with _daemon() as (daemon, url):
        port = int(url.rsplit(":", 1)[1])
        attack = Tricklers(port, n, 5.0, _TRICKLE)
        attack.start()
        try:
            time.sleep(5.0)
            result = _measured(daemon, lambda: _probes(port, seconds))
            result["reopened"] = attack.reopened
            return result
        finally:
            attack.stop()


def shape_authflood(seconds: float, n: int = 64) -> dict[str, Any]:
    return _under_wrong_passwords(
        n, _wrong_passwords_reconnecting, lambda port: _logins(port, seconds)
    )


SHAPES: dict[str, Callable[[float], dict[str, Any]]] = {
    "busy": shape_busy,
    "slowreaders": shape_slowreaders,
    "tlshellos": shape_tlshellos,
    "tlshellos-p256": lambda seconds: shape_tlshellos(seconds, ecdsa=True),
    "trickle": shape_trickle,
    "authflood": shape_authflood,
}


def run_frontshapes(*, quick: bool = False, only: tuple[str, ...] = ()) -> dict[str, Any]:
    seconds = 5.0 if quick else 20.0
    _raise_nofile(4096)
    return {
        "seconds": seconds,
        "daemon_from": os.environ.get(settings.BENCH_CHECKOUT.name) or "this install",
        "shapes": {name: run(seconds) for name, run in SHAPES.items() if not only or name in only},
        "goals": {"answered": GOAL_ANSWERED, "login_ms": GOAL_LOGIN_MS, "healthy_p99_ms": 100.0},
    }
