"""``kvsidecar bench fdlimit`` and ``bench tlsidle``: the connections' resource budget
(issue 24, round 3).

fdlimit: ``kvsidecar serve`` under a hard limit of 1,024 open files, following 256
live segments (one writer process holds them all), while 1,000 idle connections from
another address (127.0.0.2, reopened when closed) hold what descriptors they can.
Reported: probes answered from 127.0.0.1, and whether a new engine's segment created
afterwards is served (it needs descriptors to be opened).

tlsidle: the daemon's RSS against N idle TLS connections from 127.0.0.2, for a
certificate (RSA-4096 or P-256): connections that complete the handshake then send
nothing (``handshaken``), or that send a ClientHello and never answer the server's
flight (``mid``). RSS is read once the connections the daemon kept are open; the
connections it closed (at its cap) are counted.

The daemon is the real ``kvsidecar serve`` subprocess (from the current directory's
package, so running from an old checkout measures the old daemon).
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import shutil
import signal
import socket
import ssl
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from kvsidecar.bench.fleet import fd_count, proc_stat, start_daemon, stop_daemon
from kvsidecar.bench.report import percentile
from kvsidecar.protocol.writer import SegmentWriter
from tests.attacks.hostile_clients import _probe, _raise_nofile, _self_signed
from tests.attacks.hostile_front import ATTACK_ADDRESS, rsa_self_signed, web_config_for

FD_LIMIT = 1024
SEGMENTS = 256
IDLE_CONNECTIONS = 1000


class IdleClients:
    """``n`` connections from ``source`` that send nothing (or, with ``ctx``, only
    what ``opening`` sends), from one selector thread; closed ones are reopened."""

    def __init__(
        self, port: int, n: int, opening: Callable[[socket.socket], socket.socket] | None = None,
        source: str = ATTACK_ADDRESS,
    ) -> None:  # fmt: skip
        self.port, self.n, self.opening, self.source = port, n, opening, source
        self.open = 0
        self.connects = 0  # attempted
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-clients", daemon=True)

    def start(self) -> IdleClients:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _connect(self, sel: selectors.BaseSelector) -> None:
        s = socket.socket()
        self.connects += 1
        try:
            s.bind((self.source, 0))
            if self.opening is not None:
                s.settimeout(30)
                s.connect(("127.0.0.1", self.port))
                s = self.opening(s)
            s.setblocking(False)
            if self.opening is None:
                s.connect_ex(("127.0.0.1", self.port))
            sel.register(s, selectors.EVENT_READ)
        except OSError:
            s.close()  # refused or reset while opening: tried again on the next round
            return
        self.open += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        while not self._stop.is_set():
            while self.open < self.n and not self._stop.is_set():
                self._connect(sel)
            for key, _ in sel.select(0.2):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    if s.recv(65536):
                        continue  # an answer (a TLS ticket): still open
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                sel.unregister(s)  # closed by the server: reopened, as an attacker would
                s.close()
                self.open -= 1
                self.reopened += 1
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()


def _writers_main(shm_dir: str, names: list[str], ready: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # two descriptors a segment
    from tests.attacks.hostile_writers import realistic_snapshot

    writers = [SegmentWriter(n, shm_dir=shm_dir) for n in names]
    snap = realistic_snapshot(1)
    for w in writers:
        w.publish(snap)
    os.write(ready, b"r")
    while True:
        time.sleep(0.5)
        for w in writers:
            w.heartbeat()


def fork_writers(shm_dir: str, names: list[str]) -> int:
    """One child process publishing a live segment under each name; its pid once all are."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            _writers_main(shm_dir, names, wfd)
        finally:
            os._exit(0)
    os.close(wfd)
    ok = os.read(rfd, 1) == b"r"
    os.close(rfd)
    if not ok:
        os.waitpid(pid, 0)
        raise RuntimeError("the writers' process failed to start")
    return pid


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _limit_nofile(limit: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def segment_name(i: int) -> str:
    return f"kvsidecar.fd{i}.dp0.tp0.pp0"


@contextlib.contextmanager
def limited_daemon(
    shm_dir: str, *args: str, fd_limit: int = FD_LIMIT
) -> Iterator[tuple[Any, str, int]]:
    """``kvsidecar serve`` started under ``prlimit --nofile=fd_limit:fd_limit``."""
    daemon, url = start_daemon(
        shm_dir, *args, wait_for_source=False, preexec_fn=_limit_nofile(fd_limit)
    )
    try:
        yield daemon, url, int(url.rsplit(":", 1)[1])
    finally:
        stop_daemon(daemon)


def up_segments(port: int) -> set[str] | None:
    """The segments with ``kvsidecar_source_up 1`` in a scrape from 127.0.0.1 (None if
    the scrape failed)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {
        line.split('segment="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("kvsidecar_source_up{") and float(line.rsplit(" ", 1)[1]) == 1
    }


def served(port: int, name: str) -> bool:
    return name in (up_segments(port) or ())


def up_count(port: int) -> int:
    up = up_segments(port)
    return -1 if up is None else len(up)


def accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the socket listening on ``port`` (a
    listener's rx_queue in /proc/net/tcp*), -1 when none is found."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return int(fields[4].split(":")[1], 16)
    return -1


def run_fdlimit(
    *, quick: bool = False, probes: int = 4, same_address: bool = False, first_byte: bool = False
) -> dict[str, Any]:
    """Probes answered and a new engine served beside 256 segments and 1,000 idle
    connections under a hard limit of 1,024 open files; ``same_address``: the idle
    connections come from the prober's own address, 127.0.0.1 (a kubelet shares the
    node's address with every hostNetwork pod); ``first_byte``: each sends the first
    byte of a head, then nothing (the kernel's accept deferral lets it through at once)."""
    _raise_nofile(IDLE_CONNECTIONS + 256)
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-fdlimit-", dir="/dev/shm")
    names = [segment_name(i) for i in range(SEGMENTS)]
    new = segment_name(SEGMENTS)
    pids = [fork_writers(shm_dir, names)]
    # 256 realistic ranks export ~3.3 MiB together, above the default aggregate budget.
    # 257 new names at once: above --max-new-targets' default burst of 64 (admission.py).
    fast = ("--poll-interval", "0.5", "--rediscover-interval", "0.5",
            "--max-exposition-bytes", str(16 << 20),
            "--max-new-targets", str(SEGMENTS + 4))  # fmt: skip
    try:
        with limited_daemon(shm_dir, *fast, "--max-targets", str(SEGMENTS + 4)) as (d, _, port):
            deadline = time.monotonic() + 60
            while up_count(port) < SEGMENTS and time.monotonic() < deadline:
                time.sleep(0.2)
            followed = up_count(port)
            source = "127.0.0.1" if same_address else ATTACK_ADDRESS
            opening = _send(b"G") if first_byte else None
            attack = IdleClients(port, IDLE_CONNECTIONS, opening, source=source).start()
            time.sleep(3.0)  # every idle client connected (or refused)
            samples, queued = [], []
            reopened0, t_attack = attack.reopened, time.monotonic()
            for _ in range(probes):
                queued.append(accept_queue(port))  # what a probe connecting now waits behind
                samples.append(_probe(port, "/-/healthy", None, timeout=5.0))
                time.sleep(0.5 if probes <= 4 else 0.1)
            # Each reopening is one connection the daemon closed: accepted, then closed.
            closed_per_s = (attack.reopened - reopened0) / (time.monotonic() - t_attack)
            pids.append(fork_writers(shm_dir, [new]))
            t0 = time.monotonic()
            wait = 5.0 if quick else 10.0  # 10-20 rediscover intervals
            ok = False
            while time.monotonic() - t0 < wait and not (ok := served(port, new)):
                time.sleep(0.2)
            served_s = time.monotonic() - t0 if ok else None
            fds, rss = fd_count(d.pid), proc_stat(d.pid)[0]
            idle_open, reopened = attack.open, attack.reopened
            attack.stop()
    finally:
        for pid in pids:
            kill(pid)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return {
        "fd_limit": FD_LIMIT,
        "segments": SEGMENTS,
        "segments_served_before_attack": followed,
        "idle_connections": IDLE_CONNECTIONS,
        "idle_from": source,
        "idle_first_byte": first_byte,
        "idle_open_client_side": idle_open,
        "idle_reopened": reopened,
        "probes": len(samples),
        "probes_answered": sum(ok for ok, _ in samples),
        "probe_ms": [round(t * 1e3, 1) for _, t in samples],
        "probe_p99_ms": percentile([t for ok, t in samples if ok], 99) * 1e3,
        "accept_queue": queued,
        "accept_queue_median": percentile(queued, 50),
        "closed_per_s": closed_per_s,
        "load_average": os.getloadavg()[0],
        "new_engine_served": ok,
        "new_engine_served_after_s": served_s,
        "daemon_fds": fds,
        "daemon_rss_mb": rss / 2**20,
    }


# -- idle TLS connections --


# A whole request, its answer never read: the connection is the front's, not the gate's.
_SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
# Most of a request head (under its 16 KB limit), never finished.
_HALF_HEAD = b"GET /metrics HTTP/1.1\r\nX-A: " + b"a" * 8000 + b"\r\nX-B: " + b"b" * 7000


def _handshaken(ctx: ssl.SSLContext, mode: str) -> Callable[[socket.socket], socket.socket]:
    def opening(s: socket.socket) -> socket.socket:
        tls = ctx.wrap_socket(s, server_hostname="localhost", do_handshake_on_connect=True)
        if mode == "half-head":
            tls.sendall(_HALF_HEAD)
        if mode == "scraped":  # one scrape, then idle on the kept-alive connection
            tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head = tls.recv(65536)
            length = int(head.split(b"Content-Length: ", 1)[1].split(b"\r\n", 1)[0])
            got = len(head.split(b"\r\n\r\n", 1)[1])
            while got < length:
                got += len(tls.recv(65536))
        # Keep the TCP connection (and the server's TLS state) open, idle.
        return socket.socket(fileno=tls.detach())

    return opening


def _send(data: bytes) -> Callable[[socket.socket], socket.socket]:
    def opening(s: socket.socket) -> socket.socket:
        s.sendall(data)
        return s

    return opening


def _mid_handshake(ctx: ssl.SSLContext) -> Callable[[socket.socket], socket.socket]:
    def opening(s: socket.socket) -> socket.socket:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
        with contextlib.suppress(ssl.SSLWantReadError):
            obj.do_handshake()
        s.sendall(outgoing.read())  # a fresh ClientHello; the server's flight is never read
        return s

    return opening


def _rss_after(daemon_pid: int, attack: IdleClients, n: int, settle: float) -> tuple[int, int]:
    """RSS (bytes) and connections open on the daemon once the attack opened n
    connections (those the daemon closed at its cap are reopened) and the daemon's count
    stayed the same for ``settle`` seconds (at most 6 x ``settle``): on a loaded host it
    may still be accepting the last of them a second later (760 of 800 counted once)."""
    deadline = time.monotonic() + 120
    while attack.connects < n and time.monotonic() < deadline:
        time.sleep(0.1)
    # Bounded: at a cap the count can churn for as long as the attack reconnects.
    kept, since = _tcp_established(daemon_pid), time.monotonic()
    deadline = since + 6 * settle
    while time.monotonic() - since < settle and time.monotonic() < deadline:
        time.sleep(0.1)
        if (now := _tcp_established(daemon_pid)) != kept:
            kept, since = now, time.monotonic()
    return proc_stat(daemon_pid)[0], kept


def _tcp_established(pid: int) -> int:
    """Sockets the daemon holds (its descriptors that are sockets, less the listener)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return max(0, n - 1)


def run_tlsidle(
    *,
    quick: bool = False,
    cert: str = "rsa4096",
    mode: str = "handshaken",
    counts: tuple[int, ...] = (0, 250, 500, 1000),
    serve_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Daemon RSS against N idle TLS connections (one fresh daemon per N); serve_args
    are more `kvsidecar serve` flags."""
    if quick:
        counts = tuple(c for c in counts if c <= 250) or (0, 100)
    _raise_nofile(max(counts) + 256)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        ctx: ssl.SSLContext | None = None
        opening: Callable[[socket.socket], socket.socket] | None = None
        args: tuple[str, ...] = ()
        if cert == "none":  # plain: a head parked at the gate, or a scrape the front kept
            opening = _send(_HALF_HEAD if mode == "half-head" else _SCRAPE)
        else:  # "none": plain HTTP connections
            crt, key = rsa_self_signed(tmp) if cert == "rsa4096" else _self_signed(tmp)
            args = ("--web.config.file", web_config_for(tmp, crt, key))
            ctx = ssl.create_default_context(cafile=crt)
            opening = _mid_handshake(ctx) if mode == "mid" else _handshaken(ctx, mode)
        for n in counts:
            shm_dir = tempfile.mkdtemp(prefix="kvsidecar-tlsidle-", dir="/dev/shm")
            try:
                daemon, url = start_daemon(
                    shm_dir, *args, *serve_args, wait_for_source=False, context=ctx
                )
                port = int(url.rsplit(":", 1)[1])
                try:
                    base, base_socks = proc_stat(daemon.pid)[0], _tcp_established(daemon.pid)
                    attack = IdleClients(port, n, opening).start()
                    rss, kept = _rss_after(daemon.pid, attack, n, settle=1.0)
                    kept = max(0, kept - base_socks)
                    reopened = attack.reopened
                    attack.stop()
                finally:
                    stop_daemon(daemon)
            finally:
                shutil.rmtree(shm_dir, ignore_errors=True)
            rows.append({
                "connections": n,
                "kept_open": kept,
                "closed_by_daemon": reopened,
                "rss_mb": rss / 2**20,
                "baseline_rss_mb": base / 2**20,
                "kb_per_kept": (rss - base) / 1024 / kept if kept else 0.0,
            })  # fmt: skip
    return {"certificate": cert, "mode": mode, "rows": rows}
