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

Everything runs on 127.0.0.1; the daemon is the real ``kvsidecar serve`` subprocess
(started from the current directory's ``kvsidecar`` package, so running from an old
checkout measures the old daemon).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import resource
import selectors
import shutil
import socket
import ssl
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

_HTTP_TRICKLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000
# A TLS handshake record header announcing 16 KB that then arrive a byte at a time.
_TLS_TRICKLE = b"\x16\x03\x01\x40\x00" + b"\x01" * 100_000


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))


@contextlib.contextmanager
def _daemon(
    web_config: str | None = None, context: ssl.SSLContext | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-hostile-", dir="/dev/shm")
    extra = ("--web.config.file", web_config) if web_config else ()
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


def run_authflood(
    *, quick: bool = False, threads: int = 150, distinct: bool = False, cost: int = 10
) -> dict[str, Any]:
    logins = 3 if quick else 10
    _raise_nofile(threads + 256)
    salt = bcrypt.gensalt(cost)
    users = {f"user{i}": bcrypt.hashpw(f"pw{i}".encode(), salt).decode() for i in range(logins)}
    users["prometheus"] = bcrypt.hashpw(b"s3cret", salt).decode()
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        web_config = os.path.join(tmp, "web.yml")
        with open(web_config, "w") as f:
            f.write("basic_auth_users:\n")
            f.writelines(f"  {u}: '{h}'\n" for u, h in users.items())
        with _daemon(web_config) as (_daemon_proc, url):
            port = int(url.rsplit(":", 1)[1])
            stop = threading.Event()
            flood_done = [0]

            def flood(k: int) -> None:
                # One keep-alive connection per thread, as a real flood would use: a new
                # connection per attempt would exhaust the client's ephemeral ports first.
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                n = 0
                while not stop.is_set():
                    pw = f"wrong{k}-{n}" if distinct else "wrong"
                    token = base64.b64encode(f"prometheus:{pw}".encode()).decode()
                    try:
                        conn.request("GET", "/metrics", headers={"Authorization": "Basic " + token})
                        conn.getresponse().read()
                    except (OSError, http.client.HTTPException):
                        conn.close()
                        time.sleep(0.01)
                    n += 1
                conn.close()
                flood_done[0] += n

            pool = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(threads)]
            for t in pool:
                t.start()
            time.sleep(2.0)  # the flood is in full swing
            samples = []
            for i in range(logins):
                samples.append(_probe(port, "/metrics", None, timeout=30.0, auth=f"user{i}:pw{i}"))
                time.sleep(0.5)
            stop.set()
            for t in pool:
                t.join(35)
    ok = [t for good, t in samples if good]
    return {
        "threads": threads,
        "distinct_passwords": distinct,
        "bcrypt_cost": cost,
        "logins": len(samples),
        "ok": len(ok),
        "median_ms": percentile(ok, 50) * 1e3,
        "max_ms": max(ok) * 1e3 if ok else float("nan"),
        "flood_requests": flood_done[0],
        "target_ms": LOGIN_MS,
    }
