"""How many connections each of the daemon's ZMQ sockets accepts.

A PUB or ROUTER accepts every TCP connection that reaches its port, and each costs the
daemon memory of its own: a subscriber that stops reading during a full state keeps its
queue (~107 KiB measured; 900 of them took the daemon to 120 MiB anonymous). libzmq has no
cap on connections; it has ZAP (RFC 27), which asks a handler in the same context whether
to finish each handshake. `ConnectionBudget` is that handler for the sockets of one stream
(the KV-event PUBs and replay ROUTERs, or the load push's PUBs); each socket it guards
admits at most ``limit`` connections.

Neither the ZAP request nor the handshake events name the connection (ZAP gives the peer's
address without its port; ``HANDSHAKE_SUCCEEDED`` carries no descriptor), so a socket's
admitted connections are bounded from what is known, its monitor giving each connection's
descriptor when it is accepted and when it closes:

* a connection open for longer than WINDOW_S (more than the handshake interval) has been
  admitted: libzmq closes every other one at the handshake interval (HANDSHAKE_S);
* a younger one that was admitted was admitted after it was accepted, so within WINDOW_S.

So the admitted connections are at most those older than WINDOW_S plus the admissions of
the last WINDOW_S: the count a handshake is judged by. It never counts fewer than are
admitted, whatever the clients do (close early, never speak ZMTP, hold a refused handshake
open), and is exact again WINDOW_S after a change: a connection that left frees its place
within WINDOW_S. Handshakes in progress and refused connections are not admitted ones.

A refused client should come back by itself once there is room, and hold nothing while it
waits; libzmq has no ZAP status for that (measured with 256 and 900 subscribers,
docs/kv-events.md "Limits"):

* ``300`` (temporary) leaves the connection open, unanswered, until the handshake interval;
  then the client reconnects. Each held connection costs ~45 KiB (its engine and its ZAP
  pipe), so a handshake is held (HOLD) only while fewer than ``limit`` others wait: the
  connections younger than WINDOW_S, less the admissions of the last WINDOW_S (every
  young admitted one is among those), less the one asking;
* ``400`` closes it at once with an ERROR, after which a libzmq client does not reconnect
  (unless the close reached it first): the answer beyond them (CLOSE), logged with the
  peer's address. A status outside RFC 27 would close it without an ERROR, and its client
  would come back every 100-200 ms: 900 such clients kept the handler's queue full of
  handshakes, 101-109 MiB at the peak.

So a client or two past the limit (a router replaced while the old one is still
connected) waits held and comes in when a place frees; a flood (more handshakes at once
than the limit, or connections that never speak ZMTP) is closed, and what it costs stays
bounded: at most twice the limit held. The price: a client whose handshake comes while the
limit of others wait (a flood's, or ones whose clients left before the daemon saw them
close) is closed for good, and a held client whose retry comes then too.

A burst of handshakes costs memory before any is judged (libzmq accepts each and builds
its engine and ZAP pipe, ~35-45 KiB), and what the burst freed stayed resident: the I/O
thread frees it inside an arena the daemon's other threads do not allocate from (600-900
subscribers at once left 6.9-9.7 MiB behind for good). So each guarded socket listens
with a backlog of ``limit``: the rest of a burst waits in the kernel, its SYNs retried by
the clients (1 s, 3 s, ...), and reaches libzmq in waves; and once connections have
closed, the handler gives the free pages back (`malloc.release_free_memory`; when it has
been quiet TRIM_QUIET_S, or TRIM_LATEST_S into a flood that never pauses, at most once
every TRIM_EVERY_S).

If this handler fails, its socket closes, and libzmq then finishes handshakes without
asking (``ZMQ_ZAP_ENFORCE_DOMAIN`` unset): the streams stay served, unbounded, and the
failure is logged.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvsidecar.daemon import malloc

log = logging.getLogger("kvsidecar.streams")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # RFC 27: the one handler of a context
ZAP_VERSION = b"1.0"
# How long a connection may take to finish its handshake (libzmq's default is 30 s): a
# held refusal lasts this long, then its client reconnects; a connection that never
# speaks ZMTP is closed after it.
HANDSHAKE_S = 3.0
WINDOW_S = HANDSHAKE_S + 0.5  # the handshake interval, and the handler's lag
ADMIT, HOLD, CLOSE = b"200", b"300", b"400"
SAY_EVERY_S = 60.0  # refusals are logged at most this often
# Free memory given back after connections closed: once the handler has been quiet this
# long, or this long after the first close of a flood that never pauses; never more often
# than TRIM_EVERY_S (one walk of the arenas' free chunks, ~1 ms, the GIL released).
TRIM_QUIET_S, TRIM_LATEST_S, TRIM_EVERY_S = 0.1, 0.5, 0.5
MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_ids = itertools.count()


class _Guarded:
    """One guarded socket's connections, as its monitor tells them."""

    def __init__(self, name: str, monitor: zmq.Socket) -> None:
        self.name = name  # the endpoint it was bound to, for the log
        self.monitor = monitor
        # open connections: descriptor -> accepted at (time.monotonic() as the handler
        # saw the event)
        self.open: dict[int, float] = {}
        self.young: deque[tuple[float, int]] = deque()  # (accepted at, fd), by time
        self.old: set[int] = set()  # open ones accepted more than WINDOW_S ago
        self.admissions: deque[float] = deque()  # of the last WINDOW_S

    def accepted(self, fd: int, now: float) -> None:
        self.closed(fd)  # its close was not seen: the descriptor is a new connection
        self.open[fd] = now
        self.young.append((now, fd))

    def closed(self, fd: int) -> None:
        self.open.pop(fd, None)
        self.old.discard(fd)

    def admitted_bound(self, now: float) -> int:
        """At least the admitted connections open now (the module doc)."""
        young, open_ = self.young, self.open
        while young and young[0][0] <= now - WINDOW_S:
            accepted, fd = young.popleft()
            if open_.get(fd) == accepted:  # still the connection accepted then
                self.old.add(fd)
        admissions = self.admissions
        while admissions and admissions[0] <= now - WINDOW_S:
            admissions.popleft()
        return len(self.old) + len(admissions)

    def judge(self, now: float, limit: int) -> bytes:
        """The ZAP status of a handshake: admitted while under the limit, else held while
        fewer than the limit others wait (the module doc), else closed."""
        if self.admitted_bound(now) < limit:
            self.admissions.append(now)
            return ADMIT
        waiting = len(self.open) - len(self.old) - len(self.admissions) - 1
        return HOLD if waiting < limit else CLOSE


class ConnectionBudget:
    """The ZAP handler of one context: each socket it guards (`guard`, before the socket
    binds) admits at most ``limit`` connections. ``flag`` names the setting in the line
    logged when it refuses."""

    def __init__(self, ctx: zmq.Context, limit: int, flag: str, what: str) -> None:
        self.ctx = ctx
        self.limit = limit
        self.flag = flag
        self.what = what
        self.counts = {ADMIT: 0, HOLD: 0, CLOSE: 0}  # answers given, by status
        self._name = f"kvsidecar.admission.{next(_ids)}"
        self._by_domain: dict[bytes, _Guarded] = {}
        self._by_monitor: dict[zmq.Socket, _Guarded] = {}
        self._adds: deque[tuple[bytes, str, str, threading.Event]] = deque()
        self._said_at = -SAY_EVERY_S  # time.monotonic() of the last refusal logged
        self._closed_at: float | None = None  # the first close not yet given back
        self._active_at = 0.0  # the handler's last event
        self._trimmed_at = -TRIM_EVERY_S
        self._ready = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    # -- life (any thread) ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._wake(b"")
            self._thread.join(timeout=5)

    def guard(self, sock: zmq.Socket, name: str) -> None:
        """Make `sock` ask this budget at each handshake and count its connections (its
        own ``limit``); call it before `sock` binds, or its first connections are not
        counted. ``name``: the socket in the log (its endpoint)."""
        if self._thread is None or not self._thread.is_alive():
            return  # not started, or failed (logged): libzmq admits without asking
        n = next(_ids)
        domain = f"{self._name}.{n}".encode()
        sock.setsockopt(zmq.ZAP_DOMAIN, domain)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.BACKLOG, self.limit)  # a burst waits in the kernel (module doc)
        endpoint = f"inproc://{self._name}.monitor.{n}"
        sock.monitor(endpoint, MONITORED)
        watching = threading.Event()
        self._adds.append((domain, name, endpoint, watching))
        self._wake(b"add")
        watching.wait(5)

    def _wake(self, what: bytes) -> None:
        waker = self.ctx.socket(zmq.PUSH)
        try:
            waker.setsockopt(zmq.LINGER, 1000)
            waker.connect(f"inproc://{self._name}.wake")
            waker.send(what, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the handler is gone: nothing to wake
        finally:
            waker.close()

    # -- the handler's thread ---------------------------------------------------------------

    def _run(self) -> None:
        zap = self.ctx.socket(zmq.ROUTER)
        wake = self.ctx.socket(zmq.PULL)
        poller = zmq.Poller()
        try:
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(ZAP_ENDPOINT)
            wake.bind(f"inproc://{self._name}.wake")
            poller.register(zap, zmq.POLLIN)
            poller.register(wake, zmq.POLLIN)
            self._ready.set()
            while not self._stopping:
                ready = dict(poller.poll(self._until_trim_ms()))
                if ready:
                    self._active_at = time.monotonic()
                if wake in ready:
                    self._take_adds(wake, poller)
                for mon in [m for m in self._by_monitor if m in ready]:
                    self._drain(mon, poller)
                if zap in ready:
                    self._answer(zap, poller)
                self._trim()
        except Exception as e:  # a bug: fail open (libzmq admits without a handler)
            self.error = f"{type(e).__name__}: {e}"
            log.exception("%s connection budget failed: connections no longer counted", self.what)
        finally:
            self._ready.set()
            for mon in list(self._by_monitor):
                mon.close(linger=0)
            self._by_monitor.clear()
            self._by_domain.clear()
            zap.close(linger=0)
            wake.close(linger=0)

    def _trim_due(self) -> float | None:
        """When the handler gives back what closed connections freed (None: nothing to)."""
        if self._closed_at is None:
            return None
        return max(
            min(self._active_at + TRIM_QUIET_S, self._closed_at + TRIM_LATEST_S),
            self._trimmed_at + TRIM_EVERY_S,
        )

    def _until_trim_ms(self) -> int | None:
        due = self._trim_due()
        return None if due is None else max(0, math.ceil((due - time.monotonic()) * 1000))

    def _trim(self) -> None:
        due = self._trim_due()
        if due is None or time.monotonic() < due:
            return
        self._closed_at, self._trimmed_at = None, time.monotonic()
        malloc.release_free_memory()

    def _take_adds(self, wake: zmq.Socket, poller: zmq.Poller) -> None:
        while True:
            try:
                wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while self._adds:
            domain, name, endpoint, watching = self._adds.popleft()
            mon = self.ctx.socket(zmq.PAIR)
            mon.setsockopt(zmq.LINGER, 0)
            mon.setsockopt(zmq.RCVHWM, 0)  # a close lost to a full queue would count for ever
            mon.connect(endpoint)
            guarded = _Guarded(name, mon)
            self._by_domain[domain] = self._by_monitor[mon] = guarded
            poller.register(mon, zmq.POLLIN)
            watching.set()

    def _drain(self, mon: zmq.Socket, poller: zmq.Poller) -> None:
        guarded = self._by_monitor.get(mon)
        while guarded is not None:
            try:
                event = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                guarded.accepted(event["value"], time.monotonic())
            elif kind == zmq.EVENT_DISCONNECTED:
                guarded.closed(event["value"])
                if self._closed_at is None:
                    self._closed_at = time.monotonic()
            elif kind == zmq.EVENT_MONITOR_STOPPED:  # its socket closed, and its connections
                del self._by_monitor[mon]
                self._by_domain = {d: g for d, g in self._by_domain.items() if g is not guarded}
                poller.unregister(mon)
                mon.close(linger=0)
                guarded = None

    def _answer(self, zap: zmq.Socket, poller: zmq.Poller) -> None:
        while True:
            try:
                frames = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [client, b"", version, request id, domain, address, routing id, mechanism, ...]
            if len(frames) < 8 or frames[2] != ZAP_VERSION:
                continue
            guarded = self._by_domain.get(frames[4])
            status = ADMIT
            if guarded is not None:
                self._drain(guarded.monitor, poller)  # its ACCEPTED came before its request
                status = guarded.judge(time.monotonic(), self.limit)
            self.counts[status] += 1
            zap.send_multipart([frames[0], b"", ZAP_VERSION, frames[3], status,
                                b"" if status == ADMIT else b"over budget", b"", b""])  # fmt: skip
            if guarded is not None and status != ADMIT:
                self._say(guarded, frames[5].decode(errors="replace"), status)

    def _say(self, guarded: _Guarded, address: str, status: bytes) -> None:
        """A refusal: one line, at most one a minute."""
        now = time.monotonic()
        if now < self._said_at + SAY_EVERY_S:
            return
        self._said_at = now
        refused = self.counts[HOLD] + self.counts[CLOSE]
        log.warning(
            "%s %s: refused a connection from %s (%s; %d refused so far): %d are open, the "
            "most %s=%d admits. Raise %s, or let only the router reach the ports "
            "(docs/kv-events.md#limits)",
            self.what,
            guarded.name,
            address,
            f"it retries in {HANDSHAKE_S:.0f} s"
            if status == HOLD
            else "closed: a libzmq client does not retry",
            refused,
            guarded.admitted_bound(now),
            self.flag,
            self.limit,
            self.flag,
        )
