"""``kvsidecar bench slowloris`` and ``bench authflood``: a legitimate client's latency
while unauthenticated clients misbehave (issue 12 items 2 and 9).

slowloris: N connections each trickle one byte every ``interval`` seconds (an HTTP
request that never ends, or, with ``--tls``, a TLS record that never completes);
connections the server closes are reopened at once, as an attacker would. Meanwhile
a prober opens a fresh connection per request, as a kubelet probe does, and times
``/-/healthy`` and ``/metrics``. Goal: healthy p99 < 100 ms, metrics p99 < 1 s.

authflood: 150 threads hammer ``/metrics`` with a wrong password (the same one, or
with ``--distinct`` a new one each time) while a legitimate user logs in for the
first time (uncached: one fresh user per sample). Goal: the login answers < 1 s.
With ``--fresh`` every attempt comes on a new connection (connect, send, read the
answer, reset), so none of them is known to have failed before: the same-address
flood of issue 24 item 3. The login then also counts as answered in time only within
Prometheus' default 10 s scrape timeout.

Everything runs on 127.0.0.1; the daemon is the real ``kvsidecar serve`` subprocess
(started from the current directory's ``kvsidecar`` package, so running from an old
checkout measures the old daemon).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import http.client
import os
import resource
import selectors
import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import bcrypt

from kvsidecar.bench.fleet import fd_count, proc_stat, start_daemon, stop_daemon
from kvsidecar.bench.report import percentile

HEALTHY_P99_MS = 100.0
METRICS_P99_MS = 1000.0
LOGIN_MS = 1000.0
SCRAPE_TIMEOUT_S = 10.0  # Prometheus' default scrape_timeout

_HTTP_TRICKLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000
# A TLS handshake record header announcing 16 KB that then arrive a byte at a time.
_TLS_TRICKLE = b"\x16\x03\x01\x40\x00" + b"\x01" * 100_000


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))


@contextlib.contextmanager
def _daemon(
    web_config: str | None = None, context: ssl.SSLContext | None = None, *flags: str
) -> Iterator[tuple[subprocess.Popen, str]]:
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-hostile-", dir="/dev/shm")
    extra = (*(("--web.config.file", web_config) if web_config else ()), *flags)
    daemon, url = start_daemon(shm_dir, *extra, wait_for_source=False, context=context)
    try:
        yield daemon, url
    finally:
        stop_daemon(daemon)
        shutil.rmtree(shm_dir, ignore_errors=True)


def _self_signed(directory: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def received(
    sel: selectors.BaseSelector, timeout: float, size: int = 65536
) -> Iterator[tuple[socket.socket, bytes]]:
    """(socket, bytes) for each socket that became readable; b"" if it closed or failed."""
    for key, _ in sel.select(timeout):
        s = key.fileobj
        assert isinstance(s, socket.socket)
        try:
            data = s.recv(size)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        yield s, data


class Tricklers:
    """``n`` connections sending one byte of ``payload`` every ``interval`` s, from one
    selector thread; closed connections are reopened. Bounded: ``stop()`` ends it."""

    def __init__(self, port: int, n: int, interval: float, payload: bytes) -> None:
        self.port, self.n, self.interval, self.payload = port, n, interval, payload
        self.reopened = 0
        self.open = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tricklers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _connect(self, sel: selectors.BaseSelector, offset: dict[socket.socket, int]) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", self.port))
        sel.register(s, selectors.EVENT_READ)
        offset[s] = 0

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        offset: dict[socket.socket, int] = {}
        for _ in range(self.n):
            self._connect(sel, offset)
        # Spread the sends over the interval so the server sees a steady trickle.
        step = self.interval / max(1, self.n)
        order: list[socket.socket] = []
        next_send = time.monotonic()
        while not self._stop.is_set():
            timeout = max(0.0, min(0.05, next_send - time.monotonic()))
            for s, data in received(sel, timeout):
                if not data:  # closed by the server: reopen, as an attacker would
                    sel.unregister(s)
                    s.close()
                    del offset[s]
                    self.reopened += 1
                    self._connect(sel, offset)
            while time.monotonic() >= next_send:
                order = order or list(offset)
                s = order.pop()
                if s in offset:
                    with contextlib.suppress(OSError):
                        pos = offset[s]
                        s.send(self.payload[pos : pos + 1])
                        offset[s] = pos + 1
                next_send += step
            self.open = len(offset)
        for s in offset:
            s.close()
        sel.close()


def _probe(
    port: int, path: str, ctx: ssl.SSLContext | None, timeout: float, auth: str | None = None
) -> tuple[bool, float]:
    t0 = time.perf_counter()
    conn: http.client.HTTPConnection
    if ctx is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        ok = resp.status == 200
    except (OSError, http.client.HTTPException):
        ok = False
    finally:
        conn.close()
    return ok, time.perf_counter() - t0


def _summary(samples: list[tuple[bool, float]]) -> dict[str, Any]:
    ok = [t for good, t in samples if good]
    return {
        "requests": len(samples),
        "ok": len(ok),
        "p50_ms": percentile(ok, 50) * 1e3,
        "p99_ms": percentile(ok, 99) * 1e3,
        "max_ms": max(ok) * 1e3 if ok else float("nan"),
    }


def run_slowloris(
    *, quick: bool = False, connections: int = 1000, tls: bool = False, interval: float = 5.0
) -> dict[str, Any]:
    seconds = 10.0 if quick else 30.0
    _raise_nofile(connections + 256)
    with contextlib.ExitStack() as stack:
        web_config, ctx = None, None
        if tls:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvsidecar-bench-"))
            cert, key = _self_signed(tmp)
            web_config = os.path.join(tmp, "web.yml")
            with open(web_config, "w") as f:
                f.write(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
            ctx = ssl.create_default_context(cafile=cert)
        daemon, url = stack.enter_context(_daemon(web_config, ctx))
        port = int(url.rsplit(":", 1)[1])
        attack = Tricklers(port, connections, interval, _TLS_TRICKLE if tls else _HTTP_TRICKLE)
        attack.start()
        time.sleep(min(5.0, interval))  # let every trickler connect and start
        samples: dict[str, list[tuple[bool, float]]] = {"/-/healthy": [], "/metrics": []}
        cpu0, t0 = proc_stat(daemon.pid)[1], time.monotonic()
        deadline = t0 + seconds
        while time.monotonic() < deadline:
            for path, got in samples.items():
                got.append(_probe(port, path, ctx, timeout=5.0))
            time.sleep(0.05)
        open_conns = attack.open
        rss, cpu1 = proc_stat(daemon.pid)
        cpu_pct = 100 * (cpu1 - cpu0) / (time.monotonic() - t0)
        fds = fd_count(daemon.pid)
        threads = len(os.listdir(f"/proc/{daemon.pid}/task"))
        attack.stop()
    return {
        "connections": connections,
        "tls": tls,
        "interval_s": interval,
        "seconds": seconds,
        "tricklers_open": open_conns,
        "tricklers_reopened": attack.reopened,
        "daemon_rss_mb": rss / 2**20,
        "daemon_cpu_pct": cpu_pct,  # of one core, tricklers and probes together
        "daemon_fds": fds,
        "daemon_threads": threads,
        "healthy": _summary(samples["/-/healthy"]),
        "metrics": _summary(samples["/metrics"]),
        "targets": {"healthy_p99_ms": HEALTHY_P99_MS, "metrics_p99_ms": METRICS_P99_MS},
    }


def _attempt_fresh(port: int, token: str) -> int:
    """One request on a new connection; its status (0: no answer). Closed with a reset,
    as a flood would: TIME_WAIT would exhaust the client's ephemeral ports first."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(
            f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode()
        )
        head = s.recv(64)
        return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        s.close()


def _attempt_kept(conn: http.client.HTTPConnection, token: str) -> int:
    try:
        conn.request("GET", "/metrics", headers={"Authorization": "Basic " + token})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        conn.close()
        time.sleep(0.01)
        return 0


def run_authflood(
    *,
    quick: bool = False,
    threads: int = 150,
    distinct: bool = False,
    fresh: bool = False,
    cost: int = 10,
) -> dict[str, Any]:
    logins = 3 if quick else 10
    _raise_nofile(threads + 256)
    salt = bcrypt.gensalt(cost)
    users = {f"user{i}": bcrypt.hashpw(f"pw{i}".encode(), salt).decode() for i in range(logins)}
    users["prometheus"] = bcrypt.hashpw(b"s3cret", salt).decode()
    statuses: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        web_config = os.path.join(tmp, "web.yml")
        with open(web_config, "w") as f:
            f.write("basic_auth_users:\n")
            f.writelines(f"  {u}: '{h}'\n" for u, h in users.items())
        with _daemon(web_config) as (daemon, url):
            port = int(url.rsplit(":", 1)[1])
            stop = threading.Event()

            def flood(k: int) -> None:
                # Keep-alive by default, as a real flood would use; --fresh: a new
                # connection per attempt, so no attempt is known to have failed before.
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                seen: collections.Counter[int] = collections.Counter()
                n = 0
                while not stop.is_set():
                    pw = f"wrong{k}-{n}" if distinct else "wrong"
                    token = base64.b64encode(f"prometheus:{pw}".encode()).decode()
                    seen[_attempt_fresh(port, token) if fresh else _attempt_kept(conn, token)] += 1
                    n += 1
                conn.close()
                with lock:
                    statuses.update(seen)

            pool = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(threads)]
            started = time.monotonic()
            for t in pool:
                t.start()
            time.sleep(2.0)  # the flood is in full swing
            cpu0, t0 = proc_stat(daemon.pid)[1], time.monotonic()
            samples = []
            for i in range(logins):
                samples.append(_login(port, f"user{i}:pw{i}"))
                time.sleep(0.5)
            seconds = time.monotonic() - t0
            cpu = proc_stat(daemon.pid)[1] - cpu0
            stop.set()
            flood_s = time.monotonic() - started
            for t in pool:
                t.join(35)
    ok = [t for status, t in samples if status == 200]
    in_time = [t for t in ok if t < SCRAPE_TIMEOUT_S]
    return {
        "threads": threads,
        "distinct_passwords": distinct,
        "fresh_connections": fresh,
        "bcrypt_cost": cost,
        "logins": len(samples),
        "ok": len(ok),
        "ok_within_scrape_timeout": len(in_time),
        "login_statuses": dict(collections.Counter(status for status, _ in samples)),
        "median_ms": percentile(ok, 50) * 1e3,
        "max_ms": max(ok) * 1e3 if ok else float("nan"),
        "refused_median_ms": percentile([t for s, t in samples if s == 429], 50) * 1e3,
        "flood_requests": sum(statuses.values()),
        "flood_statuses": {str(k): v for k, v in sorted(statuses.items())},
        # Each distinct wrong password answered 401 took one bcrypt check (the same one
        # repeated is answered from the cache: not counted then).
        "bcrypt_checks_per_s": statuses[401] / flood_s if distinct else float("nan"),
        "seconds": seconds,
        "daemon_cpu_pct": 100 * cpu / seconds,  # of one core, over the logins' window
        "target_ms": LOGIN_MS,
    }


def _login(port: int, auth: str) -> tuple[int, float]:
    """(status, seconds) of one first login on a new connection (0: no answer in 30 s)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30.0)
    token = base64.b64encode(auth.encode()).decode()
    try:
        conn.request("GET", "/metrics", headers={"Authorization": "Basic " + token})
        resp = conn.getresponse()
        resp.read()
        status = resp.status
    except (OSError, http.client.HTTPException):
        status = 0
    finally:
        conn.close()
    return status, time.perf_counter() - t0
