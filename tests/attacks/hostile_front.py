"""``kvsidecar bench frontmix`` and ``bench scrapeflood``: the HTTP front against clients
that need no credentials (issue 24 item 1).

frontmix: over TLS (an RSA-4096 certificate, the expensive case), at once
- 20 connections pipelining ``GET /-/healthy``, 1,024 at a time, as fast as answered,
- N slow readers: each sends 256 ``GET /metrics`` and never reads the answers,
- one thread replaying a canned ClientHello (recorded once, sent on fresh
  connections closed at once: it costs the sender nothing, and an RSA signature
  each to a server that does the handshake),
while a prober opens a fresh TLS connection per ``/-/healthy``, as a kubelet does.
Reported: probes answered (of those sent), their latency, the attackers' activity.

scrapeflood: 40 keep-alive clients request ``/metrics`` back to back (from another
loopback address, 127.0.0.2, as other pods would) while a legitimate scraper asks
once a second; reported: its success rate and latency.

The daemon is the real ``kvsidecar serve`` subprocess on 127.0.0.1 (from the current
directory's package, so an old checkout measures the old daemon).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvsidecar.bench.fleet import proc_stat
from tests.attacks.hostile_clients import _daemon, _probe, _raise_nofile, _summary, received

ATTACK_ADDRESS = "127.0.0.2"  # loopback too (127/8), but another client address
PROBE_OK_TARGET = 0.95  # of probes answered under the mix
_DEPTH = 1024  # pipelined requests per batch: more than the server buffers at once
_PIPELINE = b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n" * _DEPTH
# Enough answers (256 scrapes) to fill both sides' socket buffers: the server must wait.
_UNREAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 256


def rsa_self_signed(directory: str, bits: int = 4096) -> tuple[str, str]:
    cert, key = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", f"rsa:{bits}", "-nodes", "-keyout", key,
         "-out", cert, "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def web_config_for(directory: str, cert: str, key: str) -> str:
    path = os.path.join(directory, "web.yml")
    with open(path, "w") as f:
        f.write(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
    return path


def canned_client_hello(ctx: ssl.SSLContext) -> bytes:
    """One ClientHello, recorded from a real client without any server."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


class Attack:
    """A selector thread driving many sockets; ``stop()`` ends it and closes them all."""

    def __init__(self) -> None:
        self.sent = 0  # requests or hellos sent
        self.connects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guard, name=type(self).__name__, daemon=True)

    def start(self) -> Attack:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _guard(self) -> None:
        with contextlib.suppress(OSError):
            self.run(self._stop)

    def run(self, stop: threading.Event) -> None:
        raise NotImplementedError


def _connect(port: int, source: str = ATTACK_ADDRESS) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    return s


class Pipeliners(Attack):
    """``n`` connections (plain, or TLS with ``ctx``), each sending `_DEPTH` pipelined
    ``/-/healthy`` requests at a time and reading the answers."""

    def __init__(self, port: int, n: int, ctx: ssl.SSLContext | None = None) -> None:
        super().__init__()
        self.port, self.n, self.ctx = port, n, ctx

    def _one(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(
                    ("127.0.0.1", self.port), 5, (ATTACK_ADDRESS, 0)
                ) as raw:
                    sock = (
                        self.ctx.wrap_socket(raw, server_hostname="localhost") if self.ctx else raw
                    )
                    self.connects += 1
                    while not stop.is_set():
                        sock.sendall(_PIPELINE)
                        self.sent += _DEPTH
                        got = 0
                        while got < _DEPTH and not stop.is_set():
                            chunk = sock.recv(65536)
                            if not chunk:
                                raise ConnectionResetError
                            got += chunk.count(b"HTTP/1.1 200")
            except (OSError, ssl.SSLError):
                time.sleep(0.01)

    def run(self, stop: threading.Event) -> None:
        threads = [
            threading.Thread(target=self._one, args=(stop,), daemon=True) for _ in range(self.n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class SlowReaders(Attack):
    """``n`` connections that send requests for ``/metrics`` and never read; reopened
    when closed. Over TLS the handshake is done first (then never read either)."""

    def __init__(
        self, port: int, n: int, ctx: ssl.SSLContext | None = None, source: str = ATTACK_ADDRESS
    ) -> None:
        super().__init__()
        self.port, self.n, self.ctx, self.source = port, n, ctx, source
        self.open = 0

    def _open(self) -> socket.socket | None:
        try:
            raw = socket.create_connection(("127.0.0.1", self.port), 5, (self.source, 0))
            sock = self.ctx.wrap_socket(raw, server_hostname="localhost") if self.ctx else raw
            sock.sendall(_UNREAD)
        except (OSError, ssl.SSLError):
            return None
        self.connects += 1
        self.sent += 256
        return sock

    def run(self, stop: threading.Event) -> None:
        socks: list[socket.socket] = []
        try:
            while not stop.is_set():
                alive = []
                for s in socks:  # closed by the server? (a zero-byte peek without reading)
                    try:
                        # On the raw socket: an SSLSocket refuses flags, and must not read.
                        flags = socket.MSG_PEEK | socket.MSG_DONTWAIT
                        closed = socket.socket.recv(s, 1, flags) == b""
                    except BlockingIOError:
                        closed = False
                    except (OSError, ssl.SSLError, ValueError):
                        closed = True
                    if closed:
                        s.close()
                    else:
                        alive.append(s)
                socks = alive
                while len(socks) < self.n and not stop.is_set():
                    s = self._open()
                    if s is None:
                        break
                    socks.append(s)
                self.open = len(socks)
                stop.wait(0.2)
        finally:
            for s in socks:
                s.close()


class HelloReplay(Attack):
    """Replays one canned ClientHello on fresh connections, up to ``n`` connecting at a
    time, closing each as soon as the hello is sent (it never waits for an answer)."""

    def __init__(self, port: int, hello: bytes, n: int = 64) -> None:
        super().__init__()
        self.port, self.hello, self.n = port, hello, n

    def run(self, stop: threading.Event) -> None:
        sel = selectors.DefaultSelector()
        try:
            while not stop.is_set():
                while len(sel.get_map()) < self.n:
                    sel.register(_connect(self.port), selectors.EVENT_WRITE)
                    self.connects += 1
                for key, _ in sel.select(0.05):
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    with contextlib.suppress(OSError):
                        s.send(self.hello)
                        self.sent += 1
                    sel.unregister(s)
                    s.close()
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()


def sample(probe: Callable[[], tuple[bool, float]], seconds: float, gap: float) -> list:
    samples = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples.append(probe())
        time.sleep(gap)
    return samples


@contextlib.contextmanager
def tls_daemon(cert: str, key: str) -> Iterator[tuple[subprocess.Popen, int, ssl.SSLContext]]:
    ctx = ssl.create_default_context(cafile=cert)
    with _daemon(web_config_for(os.path.dirname(cert), cert, key), ctx) as (daemon, url):
        yield daemon, int(url.rsplit(":", 1)[1]), ctx


def run_frontmix(*, quick: bool = False, slow_readers: int = 1200) -> dict[str, Any]:
    seconds = 10.0 if quick else 30.0
    slow_readers = min(slow_readers, 300) if quick else slow_readers
    _raise_nofile(slow_readers + 512)
    with (
        tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp,
        tls_daemon(*rsa_self_signed(tmp)) as (daemon, port, ctx),
    ):
        attacks = {
            "pipeliners": Pipeliners(port, 20, ctx),
            "slow_readers": SlowReaders(port, slow_readers, ctx),
            "hello_replay": HelloReplay(port, canned_client_hello(ctx)),
        }
        for a in attacks.values():
            a.start()
        time.sleep(3.0)  # every attacker connected and busy
        cpu0, t0 = proc_stat(daemon.pid)[1], time.monotonic()
        probes = sample(lambda: _probe(port, "/-/healthy", ctx, timeout=5.0), seconds, 0.2)
        rss, cpu1 = proc_stat(daemon.pid)
        cpu_pct = 100 * (cpu1 - cpu0) / (time.monotonic() - t0)
        activity = {
            name: {
                "sent": a.sent,
                "connects": a.connects,
                **({"open": a.open} if isinstance(a, SlowReaders) else {}),
            }
            for name, a in attacks.items()
        }
        for a in attacks.values():
            a.stop()
    summary = _summary(probes)
    return {
        "seconds": seconds,
        "slow_readers": slow_readers,
        "pipelining_connections": 20,
        "certificate": "RSA-4096",
        "probes": summary,
        "probes_answered_fraction": summary["ok"] / max(1, summary["requests"]),
        "attack": activity,
        "daemon_rss_mb": rss / 2**20,
        "daemon_cpu_pct": cpu_pct,
        "target_answered_fraction": PROBE_OK_TARGET,
    }


class KeepAliveScrapers(Attack):
    """``n`` keep-alive clients requesting ``/metrics`` back to back, from one selector
    thread (threads would queue on this process's GIL and flood less than a real one)."""

    REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"

    def __init__(self, port: int, n: int) -> None:
        super().__init__()
        self.port, self.n = port, n
        self.status: dict[int, int] = {}

    def _answered(self, buf: bytearray) -> bool:
        """Consume one whole answer from ``buf`` if there is one."""
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(buf[:end]).lower()
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        if len(buf) < end + 4 + length:
            return False
        status = int(head[9:12])
        self.status[status] = self.status.get(status, 0) + 1
        del buf[: end + 4 + length]
        return True

    def run(self, stop: threading.Event) -> None:
        sel = selectors.DefaultSelector()
        bufs: dict[socket.socket, bytearray] = {}

        def fresh() -> None:
            s = socket.create_connection(("127.0.0.1", self.port), 5, (ATTACK_ADDRESS, 0))
            s.sendall(self.REQUEST)
            self.sent += 1
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            bufs[s] = bytearray()
            self.connects += 1

        try:
            for _ in range(self.n):
                fresh()
            while not stop.is_set():
                for s, chunk in received(sel, 0.05, 262144):
                    if not chunk:  # closed: reconnect
                        sel.unregister(s)
                        s.close()
                        del bufs[s]
                        fresh()
                        continue
                    bufs[s] += chunk
                    while self._answered(bufs[s]):
                        s.send(self.REQUEST)  # the next one at once, on the same connection
                        self.sent += 1
        finally:
            for s in bufs:
                s.close()
            sel.close()


def run_scrapeflood(*, quick: bool = False, scrapers: int = 40) -> dict[str, Any]:
    seconds = 15.0 if quick else 60.0
    _raise_nofile(scrapers + 256)
    with _daemon() as (_proc, url):
        port = int(url.rsplit(":", 1)[1])
        flood = KeepAliveScrapers(port, scrapers).start()
        time.sleep(2.0)
        # Prometheus' default scrape timeout is 10 s.
        legit = sample(lambda: _probe(port, "/metrics", None, timeout=10.0), seconds, 1.0)
        flood.stop()
    summary = _summary(legit)
    return {
        "flood_scrapers": scrapers,
        "seconds": seconds,
        "legitimate": summary,
        "success_rate": summary["ok"] / max(1, summary["requests"]),
        "flood_status": {str(k): v for k, v in sorted(flood.status.items())},
    }
