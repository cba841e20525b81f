"""The HTTP(S) server, exporter-toolkit style: it serves routes it is given and knows
nothing of what they render.

Besides the routes, it answers ``/-/healthy`` itself and ``/-/ready`` from a readiness
callback; the web config (`config_file`) adds TLS, basic auth (never on those two: probes
carry no credentials), extra headers and a rate limit.

Robustness: a gate (`gate`, a selector thread of its own) accepts every connection and
parks it, at under 1 KB each and with its bytes left in the kernel, until a whole request
head (or TLS ClientHello) has arrived; it answers plain ``/-/healthy`` and ``/-/ready``
itself, and hands every other complete head to this front when it has room. So a
client trickling bytes or sitting idle between requests costs a parked socket, never a
place here, and no connection held here can keep a probe from being answered. The front
is one event loop thread: request heads are read under one deadline per head (not per
read); complete requests go to a small pool of worker threads (`workers`), TLS
handshakes to a thread of their own (OpenSSL computes without the GIL), so the loop
itself only moves bytes. The work one connection can queue is bounded: the loop yields
after every pipelined request, an answer is queued 64 KB at a time, and an idle plain
keep-alive connection goes back to the gate. Handshakes take turns per client address
(at most `HANDSHAKES_PER_SOURCE` each; a replayed ClientHello is closed at the gate, a
handshake whose client hung up while queued is skipped), and so do requests above
``max_requests`` (`fair`): 40 keep-alive scrapers cannot lock out a 41st. Malformed
requests get 400/414/431/505 and one throttled log line (`request`); bcrypt checks are
bounded and fair, and skipped for clients that left (`basic_auth`).

Budgets: the connection cap fits a memory budget (`CONNECTION_MEMORY`, each connection
counted at what it can keep) and leaves the open-file limit room for the daemon's
segments (``reserved_fds``), a quarter of the rest kept for the gate; at the limit
anyway, the gate spends a spare descriptor to close a parked connection rather than
stall.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import resource
import select
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsidecar.web.basic_auth import AuthGate, BasicAuth
from kvsidecar.web.compression import accepts_gzip, gzip_cached
from kvsidecar.web.config import WebConfig
from kvsidecar.web.failures import Failures, Scores
from kvsidecar.web.fair import CLEAN, NEWEST_FIRST, FairGate, Refused
from kvsidecar.web.gate import DEFER_ACCEPT_S, FRESH_GRACE_S, PARKED_MEMORY, Gate
from kvsidecar.web.listen_address import parse_listen_address
from kvsidecar.web.live_config import LiveConfig, LiveState
from kvsidecar.web.log_throttle import Throttled
from kvsidecar.web.request import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_REQUEST_LINE,
    BadRequest,
    Request,
    parse_head,
    response_head,
)
from kvsidecar.web.sockets import bind, format_address, open_fds
from kvsidecar.web.stats import HTTPStats
from kvsidecar.web.tls_context import peer_san_allowed
from kvsidecar.web.tls_stream import TLSReader, TLSWriter, handshake
from kvsidecar.web.workers import Workers

log = logging.getLogger(__name__)

__all__ = ["HEALTHY_PATH", "READY_PATH", "Render", "WebServer"]

HEALTHY_PATH = "/-/healthy"
READY_PATH = "/-/ready"
PROBE_PATHS = (HEALTHY_PATH, READY_PATH)
OTHER = "other"  # handler label for unknown paths and unparseable requests
_PLAIN = "text/plain; charset=utf-8"
# Descriptors kept free of connections besides those open at start and the caller's
# ``reserved_fds`` (a segment each target may hold): log files, directory scans, a
# segment being attached, the loop's own, the spare descriptor of `accept`.
FD_RESERVE = 64
# What one connection the front serves can keep allocated, an upper bound of `kvsidecar
# bench tlsidle` and `bench frontshapes --only slowreaders` (RSS growth per connection
# kept): plain, a client pipelining requests and never reading, ~48 KB (its requests
# buffered up to twice the 16 KB head limit before reading pauses, an answer chunk of
# 16 KB); TLS (RSA-4096) 55 KB with a head at its limit, 40 KB idle after a scrape, 33 KB
# after the handshake. Connections without a whole head, or idle between requests, are
# the gate's (`kvsidecar.web.gate.PARKED_BYTES`, under 1 KB each).
PLAIN_CONNECTION_BYTES = 48 << 10
TLS_CONNECTION_BYTES = 64 << 10
# What served connections may cost together: with the daemon's own worst case under its
# default budgets (~45 MB RSS with maximal targets, docs/reliability.md) the Kubernetes
# sidecar's 64Mi limit keeps > 10 MB of headroom. Caps 256 plain, 192 TLS connections.
CONNECTION_MEMORY = 12 << 20
RENDER_THREADS = 8
FAILED_AUTH_DELAY_S = 0.2  # tarpit for wrong credentials
FAILED_HOSTS_MEMORY = 4096  # addresses remembered as having sent wrong credentials
READY_TIMEOUT_S = 5.0  # /-/ready answers 503 rather than hang behind a stuck check
# TLS handshakes run on their own thread (OpenSSL releases the GIL for the RSA work):
# one, so a handshake flood costs at most one core and the loop keeps the other.
HANDSHAKE_THREADS = 1
HANDSHAKES_PER_SOURCE = 8  # waiting or running, per client address; beyond: closed at once
# ClientHellos the front takes from the gate at once, until each has had its first
# handshake step (the server's flight): the others wait at the gate, newest of each
# address first, closed there if their client hangs up. A queue of hundreds here would
# be served oldest first, its clients long gone (a kubelet waits 1 s).
HANDSHAKE_PLACES = 4
MAX_HANDSHAKES_WAITING = 256
WRITE_CHUNK = 16384  # an answer is queued this much at a time: bounded unread bytes
RENDER_WAIT_S = 5.0  # above max_requests a request waits its turn this long, then 503

Render = Callable[[Request], tuple[bytes, str]]
"""A route: runs on a worker thread, returns the body and its content type."""


def _always_ready() -> tuple[bool, str]:
    return True, ""


@dataclass(eq=False)
class _Conn:
    reader: asyncio.StreamReader | TLSReader
    writer: asyncio.StreamWriter | TLSWriter
    peer: str  # host:port, for the log
    host: str  # the address alone: the auth queue's fairness key
    task: asyncio.Task | None = None
    # Wrong credentials it sent: from the second on (a flood over keep-alive), its next
    # checks queue last; one (a credential rotation) is its address's score's business.
    failures: int = 0
    # Completed a ClientHello or a request head: while idle, closed at the cap only after
    # those that never did (tricklers), so reconnecting tricklers from a probe's own
    # address cannot close the probe mid-handshake whatever the cap.
    progressed: bool = False
    born: float = field(default_factory=time.monotonic)
    # Holds one of the front's `HANDSHAKE_PLACES` until its first handshake step is done.
    hello_place: Callable[[], None] | None = None
    # What it is told if closed at the cap while its credentials wait (for a bcrypt turn,
    # or sitting out a wrong password's pause): a request that presented credentials is
    # answered or refused with a status, never dropped (issue 43 item 3).
    owed: bytes | None = None


_AUTH_BUSY = b"429 too many authentication attempts, try again later\n"
_FRONT_FULL = b"503 too many connections, try again later\n"


def _refusal(status: int, body: bytes, headers: Mapping[str, str]) -> bytes:
    """A whole answer that closes the connection, to write at once when it is closed."""
    items = [("Content-Type", _PLAIN), ("Content-Length", str(len(body))), *headers.items()]
    return response_head(status, items, close=True) + body


async def _read_head(reader: asyncio.StreamReader | TLSReader, lines: list[bytes]) -> bool:
    """Read a request head into ``lines``; False on a clean close before any byte.
    Bounded in size here; in time by the caller's deadline."""
    total = 0
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            too_long = (431, "header too large") if lines else (414, "request line too long")
            raise BadRequest(*too_long) from None
        except asyncio.IncompleteReadError as e:
            if total == 0 and not e.partial:
                return False
            # Half-closed mid-request: it can still read the answer.
            raise BadRequest(400, "incomplete request head") from None
        total += len(line)
        if not lines:
            if len(line) > MAX_REQUEST_LINE + 2:
                raise BadRequest(414, "request line too long")
            if line in (b"\r\n", b"\n") and total <= 8:
                continue  # RFC 9112 2.2: ignore a few empty lines before a request
        elif total > MAX_HEAD_BYTES:
            raise BadRequest(431, "request head too large")
        elif line in (b"\r\n", b"\n"):
            return True
        lines.append(line)
        if len(lines) > MAX_HEADERS + 1:
            raise BadRequest(431, f"more than {MAX_HEADERS} header fields")


def _remember(recent: OrderedDict[str, None], host: str) -> None:
    """Note ``host`` as the most recent in a bounded memory of addresses."""
    recent[host] = None
    recent.move_to_end(host)
    if len(recent) > FAILED_HOSTS_MEMORY:
        recent.popitem(last=False)


def _hung_up(conn: _Conn) -> bool:
    """The client shut its side (or reset), seen by the kernel even when asyncio has
    already read its bytes into our buffer: a queued handshake for nobody."""
    sock = conn.writer.get_extra_info("socket")
    if sock is None:
        return _gone(conn)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0)) or _gone(conn)


def _gone(conn: _Conn) -> bool:
    """The client hung up (EOF or an error seen by the transport) or was evicted."""
    reader = conn.reader.raw if isinstance(conn.reader, TLSReader) else conn.reader
    return conn.writer.transport.is_closing() or reader.at_eof() or reader.exception() is not None


class _Front:
    """The asyncio side: accepts, TLS handshakes and request heads for every connection in
    one thread, under a deadline per request head. Only complete requests reach the
    worker threads, so an idle or trickling client costs a socket and a few KB, never a
    thread. /-/healthy is answered right here; /-/ready and basic auth have threads of
    their own, so neither queues behind rendering (nor each other)."""

    def __init__(self, web: WebServer, max_connections: int) -> None:
        self.web = web
        self.max_connections = max_connections
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        # Renders hold the GIL: more threads would not make them faster, only queue
        # inside the interpreter. Up to max_requests are admitted, RENDER_THREADS run.
        self.render_pool = Workers(RENDER_THREADS, "kvsidecar-http")
        self.probe_pool = Workers(2, "kvsidecar-probe")
        self.auth_gate = AuthGate()
        self.tls_pool = concurrent.futures.ThreadPoolExecutor(HANDSHAKE_THREADS, "kvsidecar-tls")
        self.handshakes = FairGate(
            HANDSHAKE_THREADS, MAX_HANDSHAKES_WAITING, per_key=HANDSHAKES_PER_SOURCE
        )
        # Requests above max_requests wait their turn, round-robin per address, instead of
        # 503 at once: 40 keep-alive scrapers cannot hold every slot against a 41st.
        slots = web.max_requests or max(1, max_connections)
        self.requests = FairGate(slots, max(64, max_connections))
        self.open: set[_Conn] = set()
        # Open connections per client address, oldest first: at the cap the victim comes
        # from the address holding the most, so a flood from one address (or a few)
        # cannot lock out a kubelet or a scraper from another.
        self.by_host: dict[str, dict[_Conn, None]] = {}
        # Connections waiting for a request head (or a handshake), oldest first: the ones
        # closed to make room when the cap is reached. Busy ones are never evicted.
        self.waiting: OrderedDict[_Conn, None] = OrderedDict()
        self.fresh: OrderedDict[_Conn, None] = OrderedDict()  # those that never progressed
        # Connections whose answer waits for the client to read it, oldest first: closed
        # before any of those, since they already took their answer (slow readers).
        self.stalled: OrderedDict[_Conn, None] = OrderedDict()
        # Connections sitting out the pause after wrong credentials, oldest first: closed
        # before any other. They are busy only with being refused, so at the cap they
        # must not count as being answered: 420 addresses each re-sending a wrong
        # password would otherwise leave nothing evictable and refuse every probe.
        self.failing: OrderedDict[_Conn, None] = OrderedDict()
        # Connections whose request waits for a render slot: nothing was done for them
        # yet, so closing one costs no work. Without this, slow readers from a probe's
        # own address fill the cap with queued scrapes and leave it nothing to close.
        self.queued: OrderedDict[_Conn, None] = OrderedDict()
        # Connections whose first credentials wait for a bcrypt turn: evictable last, for
        # the same reason (a queue of distinct wrong passwords must not hold the cap).
        self.checking: OrderedDict[_Conn, None] = OrderedDict()
        # Addresses that sent wrong credentials lately, as decaying scores (bounded, oldest
        # forgotten): a new connection from a suspect one is suspect from its first check,
        # so reconnecting after an eviction does not buy an attacker the protection of a
        # first login; one wrong password a while ago does not put an address behind a
        # flood (`failures.Failures`).
        self.failures = Failures(FAILED_HOSTS_MEMORY)
        # Requests per address that waited for a bcrypt check lately (decaying): at the
        # cap, a waiting check of the address sending the most goes first, so a flood
        # retrying at once is refused before a scraper's one login (`_victim`).
        self.auth_attempts = Scores(FAILED_HOSTS_MEMORY)
        # Addresses that had a bcrypt check lately, and those that logged in lately
        # (bounded, oldest forgotten): the auth gate's ranks (`basic_auth.AuthGate`).
        self.checked_hosts: OrderedDict[str, None] = OrderedDict()
        self.good_hosts: OrderedDict[str, None] = OrderedDict()
        self.gate: Gate | None = None
        self.connecting: set[asyncio.Task] = set()  # strong references until set up
        self.unadmitted = 0  # accepted, not yet through _admit
        self.hellos = 0  # TLS: taken from the gate, first handshake step not yet done
        self.log_bad = Throttled(log, logging.INFO)
        self.log_loop = Throttled(log, logging.WARNING)
        self.log_limit = Throttled(log, logging.WARNING)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        self.log_loop("http: %s%s", context.get("message", "error"), f": {exc!r}" if exc else "")

    # -- admission --

    def _admit(self, conn: _Conn) -> bool:
        cap = self.cap()
        if cap and len(self.open) >= cap:
            victim = self._victim(conn.host)
            if victim is None:
                return False  # every connection is being answered: not the newcomer
            if victim.host == conn.host and self._queues_at_gate() and self._owed_an_answer(victim):
                # One request of an address for another of the same address: the
                # newcomer's waits at the gate for room instead (`_to_gate`). Between
                # addresses the heavier one pays, told why (`_victim`).
                return False
            self.web.stats.connection_rejected()
            self._drop(victim)
        self.open.add(conn)
        self.by_host.setdefault(conn.host, {})[conn] = None
        self.fresh[conn] = None
        return True

    def cap(self) -> int:
        """The connection cap now (0 = none): the descriptors' (``max_connections``) and
        the memory budget's, which depends on whether TLS is on (a reload can turn it on)."""
        tls = self.web._live.peek().ssl_context is not None  # a reload cannot change it
        per = TLS_CONNECTION_BYTES if tls else PLAIN_CONNECTION_BYTES
        by_memory = max(1, self.web.connection_memory // per) if self.web.connection_memory else 0
        caps = [c for c in (self.max_connections, by_memory) if c]
        return min(caps) if caps else 0

    def _victim(self, host: str) -> _Conn | None:
        """Who makes room for a newcomer from ``host`` (`_victim_by_tier`), unless that is a
        request still owed its answer from an address with a lower bcrypt score
        (`_badness`) than the newcomer's: then the newcomer is refused (a 503 with
        Retry-After, its head unread). A flood of wrong passwords, which raises its
        addresses' scores, cannot close a login from an address that sent none (or one a
        while ago) to make room for itself, however fast it reconnects; the login,
        arriving, closes the flood's."""
        victim = self._victim_by_tier(host)
        if victim is None or victim.host == host or not self._owed_an_answer(victim):
            return victim
        return None if self._badness(host) > self._badness(victim.host) else victim

    def _owed_an_answer(self, conn: _Conn) -> bool:
        """Its request is waiting (a bcrypt turn, a render slot) or not yet read: closing
        it costs its client an answer, where an idle or stalled one loses nothing."""
        return conn in self.checking or conn in self.queued or conn in self.fresh

    def _victim_by_tier(self, host: str) -> _Conn | None:
        """An address holding more than the newcomer's would after admission gives one up
        (stalled on its reader first, then idle, then its oldest). Otherwise the newcomer's
        own address pays (stalled, then idle; if none, the newcomer is refused), and a
        newcomer from a new address when every address holds one takes anyone's stalled
        or idle connection, oldest first (waiting for a bcrypt turn: the address with the
        highest wrong-password score, then sending the most checks, first)."""
        heaviest = max(self.by_host, key=lambda h: len(self.by_host[h]))
        mine = len(self.by_host.get(host, ()))
        if len(self.by_host[heaviest]) > mine + 1:
            return self._oldest_of(heaviest) or next(iter(self.by_host[heaviest]))
        if mine:
            return self._oldest_of(host)  # None: refused, lighter addresses keep theirs
        idle = (
            self.failing
            or self.stalled
            or self._settled(self.fresh)
            or self.waiting
            or self.queued
            or self.checking
            or self.fresh
        )
        if idle is self.checking:  # refused 429 (`_Conn.owed`): the worst address first
            return max(self.checking, key=lambda c: self._badness(c.host))
        return next(iter(idle)) if idle else None

    def _badness(self, host: str) -> float:
        """What ``host`` asked of bcrypt lately: its bcrypt-bound requests plus its wrong
        passwords (each decaying, `failures.HALF_LIFE_S`). Both count: a flood in a small
        front is refused before its checks run, so it has requests but no failures."""
        return self.failures.score(host) + self.auth_attempts.score(host)

    @staticmethod
    def _settled(tier: OrderedDict[_Conn, None]) -> OrderedDict[_Conn, None] | None:
        """``tier`` if its oldest had `FRESH_GRACE_S` to send a head, else None: a
        connection accepted a moment ago is no trickler yet, and closing it would let
        reconnecting attackers close every probe before its first byte arrives."""
        oldest = next(iter(tier), None)
        if oldest is None or time.monotonic() - oldest.born < FRESH_GRACE_S:
            return None
        return tier

    def _oldest_of(self, host: str) -> _Conn | None:
        tiers = (self.failing, self.stalled, self.fresh, self.waiting, self.queued, self.checking)
        for tier in tiers:
            for c in tier:  # oldest first; only at the cap, so the scan is rare
                if c.host == host:
                    return c
        return None

    def _forget(self, conn: _Conn) -> None:
        if conn in self.open and self.gate is not None:
            self.gate.wake()  # room for a head waiting at the gate
        self.open.discard(conn)
        self.waiting.pop(conn, None)
        self.fresh.pop(conn, None)
        self.stalled.pop(conn, None)
        self.failing.pop(conn, None)
        self.checking.pop(conn, None)
        self.queued.pop(conn, None)
        conns = self.by_host.get(conn.host)
        if conns is not None:
            conns.pop(conn, None)
            if not conns:
                del self.by_host[conn.host]

    def _drop(self, conn: _Conn) -> None:
        self._forget(conn)
        owed, conn.owed = conn.owed, None
        if owed is None:
            conn.writer.transport.abort()
        else:
            # A few hundred bytes into an idle send buffer: written now, then closed.
            with contextlib.suppress(OSError, ssl.SSLError, RuntimeError):
                conn.writer.write(owed)
            conn.writer.transport.close()
        if conn.task is not None and conn.task is not asyncio.current_task(self.loop):
            conn.task.cancel()

    def _set_waiting(self, conn: _Conn, waiting: bool) -> None:
        tier = self.waiting if conn.progressed else self.fresh
        if waiting:
            tier[conn] = None  # to the young end: it just did something useful
            tier.move_to_end(conn)
        else:
            tier.pop(conn, None)

    # -- one connection --

    def _accepted(self, sock: socket.socket) -> None:
        # What asyncio.start_server does per connection, minus its accept loop. Until
        # _admit the connection counts in `unadmitted` (it holds a descriptor already).
        self.unadmitted += 1
        if self.gate is not None:
            self.gate.arrived()
        pending = [True]
        hello = [True] if self.gate is not None and self.gate.tls else []
        self.hellos += len(hello)

        def hello_done() -> None:
            if hello:
                hello.clear()
                self.hellos -= 1
                if self.gate is not None:
                    self.gate.wake()

        def admitting() -> None:
            if pending:
                pending.clear()
                self.unadmitted -= 1
                if self.gate is not None:
                    self.gate.wake()

        async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            admitting()
            try:
                await self.client(reader, writer, hello_done)
            finally:
                hello_done()

        async def connect() -> None:
            try:
                await self.loop.connect_accepted_socket(lambda: protocol, sock)
            except OSError:
                sock.close()  # reset before it was set up: the client is gone
                admitting()  # a no-op if it got as far as client()
                hello_done()

        reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES, loop=self.loop)
        protocol = asyncio.StreamReaderProtocol(reader, client, loop=self.loop)
        task = self.loop.create_task(connect())
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)

    async def client(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello_done: Callable[[], None] | None = None,
    ) -> None:
        peername = writer.get_extra_info("peername") or ("?", 0)
        conn = _Conn(reader, writer, format_address(peername), str(peername[0]))
        conn.hello_place = hello_done
        conn.task = asyncio.current_task()
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # asyncio only sets this for sockets it created itself (proto 6); without it a
            # reply sent while TLS session tickets are unacknowledged waits 40 ms.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._admit(conn):
            # Plain: the whole head waits at the gate again, first of its address, for
            # room (`Gate.give_back`); refused with a status only at the open-file limit,
            # never dropped. TLS: a handed hello cannot wait, nothing can be said before
            # a handshake.
            gate = self.gate if self._queues_at_gate() else None
            if gate is not None and self._to_gate(conn, gate.give_back):
                return
            self.web.stats.connection_rejected()
            if gate is not None:
                conn.owed = _refusal(503, _FRONT_FULL, {"Retry-After": "1"})
                self._drop(conn)
            else:
                writer.transport.abort()
            return
        writer.transport.set_write_buffer_limits(high=WRITE_CHUNK)
        if self.gate is not None and not self.gate.tls:
            # A whole head came from the gate: if closed before it is read, it is refused
            # with a status, not dropped (cleared once the head is read).
            conn.owed = _refusal(503, _FRONT_FULL, {"Retry-After": "1"})
        try:
            state = self.web._live.current()
            if state.ssl_context is not None and not await self._handshake(conn, state):
                return
            while await self._one_request(conn):
                if self._back_to_gate(conn):
                    return
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass  # reset, broken pipe, a TLS error after the handshake: the client's doing
        except asyncio.CancelledError:
            pass  # evicted, or shutting down
        except Exception as e:  # a bug: one line, never a traceback per request
            log.error("http: connection from %s failed: %r", conn.peer, e)
            log.debug("http: traceback", exc_info=True)
        finally:
            self._forget(conn)
            if not writer.transport.is_closing():
                writer.transport.abort()

    def _queues_at_gate(self) -> bool:
        """Plain: a whole head handed by the gate can wait there again for room (TLS: a
        hello, whose handshake is under way once handed, cannot)."""
        return self.gate is not None and not self.gate.tls

    def _to_gate(self, conn: _Conn, hand: Callable[[socket.socket, str], None]) -> bool:
        """``conn``'s socket to the gate (``hand``: `Gate.adopt` or `Gate.give_back`): it
        is duplicated and the transport dropped, which closes only our old descriptor.
        False at the open-file limit: it stays here."""
        sock = conn.writer.get_extra_info("socket")
        try:
            kept = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            return False
        self._forget(conn)
        conn.writer.transport.abort()
        hand(kept, conn.host)
        return True

    def _back_to_gate(self, conn: _Conn) -> bool:
        """An idle plain keep-alive connection (answered, nothing buffered either way) goes
        back to the gate to wait for its next head there, at no cost to the front: only
        connections being served count under the front's cap (`_to_gate`)."""
        reader = conn.reader
        if (
            self.gate is None
            or not isinstance(reader, asyncio.StreamReader)
            or reader._buffer  # pipelined bytes already read: answer them here
            or conn.writer.transport.get_write_buffer_size()
            or _gone(conn)
        ):
            return False
        return self._to_gate(conn, self.gate.adopt)

    async def _handshake(self, conn: _Conn, state: LiveState) -> bool:
        assert state.ssl_context is not None and state.cfg is not None
        tls = state.cfg.tls
        try:
            async with asyncio.timeout(self.web.request_timeout_s):
                reader, writer = await handshake(
                    state.ssl_context,
                    conn.reader,
                    conn.writer,
                    step=lambda fn: self._handshake_step(conn, fn),
                )
            if (
                tls is not None
                and tls.client_allowed_sans
                and not peer_san_allowed(writer.get_extra_info("peercert"), tls.client_allowed_sans)
            ):
                raise ssl.SSLError("client certificate SANs not in client_allowed_sans")
        except (OSError, ValueError, TimeoutError, Refused) as e:
            self.web.stats.tls_handshake_failed()
            log.debug("TLS handshake with %s failed: %r", conn.peer, e)
            return False
        if self.gate is not None:
            self.gate.shook(conn.host)
        reader.limit = MAX_HEAD_BYTES
        conn.reader, conn.writer = reader, writer
        return True

    async def _handshake_step(self, conn: _Conn, fn: Callable[[], None]) -> None:
        # The CPU off the loop, in turns fair per address, at most a few per address.
        # Meanwhile the connection is not evictable: below the TLS cap's few hundred, a
        # flood of reconnecting tricklers could otherwise close each probe mid-handshake
        # (the gate bounds how many are protected; a client silent between steps is not).
        conn.progressed = True  # a whole ClientHello (or the next flight)
        self._set_waiting(conn, False)
        self.fresh.pop(conn, None)
        try:
            async with self.handshakes.turn(conn.host):
                if _hung_up(conn):
                    # Its client left while it waited its turn: no signature for nobody.
                    raise ConnectionResetError("client closed before its handshake turn")
                await self.loop.run_in_executor(self.tls_pool, fn)
        finally:
            if conn.hello_place is not None:
                conn.hello_place()  # the server's flight is out: the next hello's turn
                conn.hello_place = None
            if conn in self.open:
                self._set_waiting(conn, True)

    async def _one_request(self, conn: _Conn) -> bool:
        """Read and answer one request; True to keep the connection for another."""
        web = self.web
        self._set_waiting(conn, True)
        lines: list[bytes] = []
        try:
            # One deadline for the whole head (Go's ReadHeaderTimeout), not one per read:
            # a byte every few seconds no longer keeps a request alive forever.
            async with asyncio.timeout(web.request_timeout_s):
                if not await _read_head(conn.reader, lines):
                    return False
                request = parse_head(lines)
        except TimeoutError:
            if lines:  # a client that sent a whole request line is told it was too slow
                await self._error(conn, BadRequest(408, "request head not received in time"))
            return False
        except BadRequest as e:
            await self._error(conn, e)
            return False
        self.fresh.pop(conn, None)
        conn.owed = None
        conn.progressed = True
        self._set_waiting(conn, False)
        t0 = time.monotonic()
        status, route = await self._answer(conn, request)
        web.stats.observe(route, status, time.monotonic() - t0)
        # Pipelined requests are already buffered, so nothing above had to wait: yield,
        # or one connection's pipeline would hold the loop (and every probe) until empty.
        await asyncio.sleep(0)
        return request.keep_alive

    async def _error(self, conn: _Conn, error: BadRequest) -> None:
        conn.owed = None  # told this instead
        self._set_waiting(conn, False)
        self.log_bad("http: %d from %s: %s", error.status, conn.peer, error.reason)
        self.web.stats.observe(OTHER, error.status, 0.0)
        body = f"{error.status} {error.reason}\n".encode()
        await self._write(
            conn, error.status, body, error.headers, _PLAIN, close=True, head_only=False
        )
        await self._linger(conn)

    async def _answer(self, conn: _Conn, request: Request) -> tuple[int, str]:
        web = self.web
        path = request.path
        known = path in web.routes or path in PROBE_PATHS
        state = web._live.current()
        headers = dict(state.cfg.http.headers) if state.cfg is not None else {}
        ctype = _PLAIN
        close = not request.keep_alive
        if path == HEALTHY_PATH:
            status, body = 200, b"OK"  # always, never behind auth: probes carry no credentials
        elif path == READY_PATH:
            ok, reason = await self._ready()
            # The reason either way: a 200 can still carry a warning (discovery failing).
            status = 200 if ok else 503
            body = (reason or ("OK" if ok else "not ready")).encode()
        elif state.bucket is not None and not state.bucket.allow():
            status, body = 429, b"429 too many requests\n"
        elif (
            state.auth.enabled
            and (verdict := await self._authorized(conn, state, request)) is not True
        ):
            if verdict is None:
                headers["Retry-After"] = "1"
                status, body = 429, _AUTH_BUSY
            else:
                headers["WWW-Authenticate"] = f'Basic realm="{web.realm}"'
                status, body = 401, b"401 unauthorized\n"
                if request.header("authorization"):
                    # Wrong credentials answer after a pause (known and unknown users
                    # alike): a coroutine asleep costs nothing, and a flood repeating a
                    # cached wrong password can no longer saturate the loop.
                    self.failing[conn] = None  # evictable first while it sits out the pause
                    conn.owed = _refusal(status, body, headers)  # its 401, without the pause
                    try:
                        await asyncio.sleep(FAILED_AUTH_DELAY_S)
                    finally:
                        conn.owed = None
                        self.failing.pop(conn, None)
        elif not known:
            status, body = 404, b"404 page not found\n"
        else:
            status, body, ctype = await self._render(conn, request, headers)
        if request.version < (1, 1) and not close:
            headers["Connection"] = "keep-alive"  # HTTP/1.0 closes unless told otherwise
        await self._write(conn, status, body, headers, ctype, close, request.method == "HEAD")
        if close and request.has_body:
            await self._linger(conn)  # the unread body must not turn the close into a RST
        elif close:
            self._close(conn)
        return status, path if known else OTHER

    async def _render(
        self, conn: _Conn, request: Request, headers: dict[str, str]
    ) -> tuple[int, bytes, str]:
        web = self.web
        self.queued[conn] = None  # closable at the cap until its turn comes
        try:
            async with self.requests.turn(conn.host, wait_s=RENDER_WAIT_S):
                self.queued.pop(conn, None)
                web.stats.request_started()
                try:
                    body, ctype, extra = await self.render_pool.submit(
                        self.loop, web._render, request.path, request
                    )
                except Exception:
                    log.exception("rendering %s failed", request.path)
                    return 500, b"500 internal server error, see the kvsidecar log\n", _PLAIN
                finally:
                    web.stats.request_finished()
        except Refused:
            return 503, b"503 too many concurrent requests, try again later\n", _PLAIN
        finally:
            self.queued.pop(conn, None)
        headers.update(extra)
        return 200, body, ctype

    async def _ready(self) -> tuple[bool, str]:
        try:
            return await asyncio.wait_for(
                self.probe_pool.submit(self.loop, self.web.ready),
                READY_TIMEOUT_S,
            )
        except TimeoutError:
            return False, f"not ready: readiness check took over {READY_TIMEOUT_S:g} s"
        except Exception as e:
            log.exception("readiness check failed")
            return False, f"readiness check failed: {e}"

    async def _authorized(self, conn: _Conn, state: LiveState, request: Request) -> bool | None:
        """True, False, or None when too many checks are queued (answered 429)."""
        creds = BasicAuth.parse_header(request.header("authorization") or None)
        if creds is None:
            return False
        cached = state.auth.lookup(*creds)
        if cached is not None:
            self._note_outcome(conn, cached)
            return cached
        auth = state.auth
        suspect = conn.failures >= 2 or self.failures.suspect(conn.host)
        tier = self.failing if suspect else self.checking
        tier[conn] = None  # queued for bcrypt: closable at the cap (see self.failing)
        conn.owed = _refusal(429, _AUTH_BUSY, {"Retry-After": "1"})  # if closed so
        if conn.host in self.good_hosts:
            rank = 0
        elif conn.host not in self.checked_hosts or conn.host in self.failures:
            # Never checked, or one wrong password a while ago (`failures.Failures`):
            # the newest first, so a flood that began earlier delays it by one check.
            rank = NEWEST_FIRST
        else:
            rank = CLEAN
        _remember(self.checked_hosts, conn.host)
        self.auth_attempts.add(conn.host)
        try:
            ok = await self.auth_gate.run(
                conn.host,
                lambda: auth.verify(*creds),
                suspect,
                gone=lambda: _gone(conn),
                rank=rank,
            )
        finally:
            conn.owed = None
            tier.pop(conn, None)
        if ok is not None:
            self._note_outcome(conn, ok)
        return ok

    def _note_outcome(self, conn: _Conn, ok: bool) -> None:
        if ok:
            _remember(self.good_hosts, conn.host)
            return
        conn.failures += 1
        self.failures.add(conn.host)

    async def _write(
        self,
        conn: _Conn,
        status: int,
        body: bytes,
        headers: Mapping[str, str],
        ctype: str,
        close: bool,
        head_only: bool,
    ) -> None:
        items = [("Content-Type", ctype), ("Content-Length", str(len(body))), *headers.items()]
        head = response_head(status, items, close=close)
        if head_only:
            chunks = [head]
        elif len(body) < 16384:
            chunks = [head + body]  # one segment: small answers arrive whole
        else:
            view = memoryview(body)  # slices share the (cached) body: no copy per reader
            chunks = [head, *(view[i : i + WRITE_CHUNK] for i in range(0, len(body), WRITE_CHUNK))]
        # A client that does not read its answer is dropped after the same deadline, and
        # never holds more than about two chunks of unsent bytes in our buffers meanwhile.
        # While it keeps us waiting it is the first closed at the connection cap.
        transport = conn.writer.transport
        async with asyncio.timeout(self.web.request_timeout_s):
            for chunk in chunks:
                conn.writer.write(chunk)
                if transport.get_write_buffer_size() > WRITE_CHUNK:
                    self.stalled[conn] = None
                    try:
                        await conn.writer.drain()
                    finally:
                        self.stalled.pop(conn, None)

    def _close(self, conn: _Conn) -> None:
        self._forget(conn)
        conn.writer.close()

    async def _linger(self, conn: _Conn) -> None:
        # After an error the client may still be sending (a huge header): closing with
        # unread data sends RST, which can destroy the reply before the client reads it.
        # Half-close, then drain briefly, as Go's net/http does.
        try:
            if conn.writer.can_write_eof():
                conn.writer.write_eof()
            received = 0
            async with asyncio.timeout(1.0):
                while received < (1 << 20):
                    chunk = await conn.reader.read(65536)
                    if not chunk:
                        break
                    received += len(chunk)
        except (OSError, TimeoutError, RuntimeError):
            pass
        self._close(conn)

    # -- lifecycle --

    def run(self, sockets: Sequence[socket.socket], started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        web = self.web
        try:
            self.gate = Gate(
                sockets,
                hand_off=lambda sock: self.loop.call_soon_threadsafe(self._accepted, sock),
                tls=web._live.peek().ssl_context is not None,  # fixed until a restart
                headers=self._config_headers,
                ready=web.ready,
                observe=web.stats.observe,
                rejected=web.stats.connection_rejected,
                room=lambda: web.fd_room - len(self.open) - self.unadmitted,
                front_room=self._front_room,
                head_timeout_s=web.request_timeout_s,
                parked_memory=web.parked_memory,
                defer_accept_s=web.defer_accept_s,
            )
            self.gate.start()
        finally:
            started.set()
        self.loop.run_forever()
        # Stopped: drop what is left, let cancelled tasks finish, then close the loop.
        for conn in list(self.open):
            self._drop(conn)
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=2))
        self.loop.close()

    def _front_room(self) -> int:
        """Connections the front can take now: free places, and places of connections
        it would close for a newcomer (`_victim`: sitting out a wrong password, stalled
        on a slow reader, waiting for a bcrypt turn or for its client), so a flood of those
        cannot hold the front against a login or a scrape."""
        cap = self.cap()
        if not cap:
            return 1 << 30
        # TLS connections stay here between requests and between handshake flights
        # (plain ones go back to the gate): waiting for their client, closable too.
        closable = len(self.failing) + len(self.stalled) + len(self.checking) + len(self.waiting)
        room = cap - len(self.open) - self.unadmitted + closable
        if self.gate is not None and self.gate.tls:
            # Hellos wait at the gate until a handshake place is free (`HANDSHAKE_PLACES`).
            room = min(room, HANDSHAKE_PLACES - self.hellos)
        return room

    def _config_headers(self) -> Mapping[str, str]:
        state = self.web._live.peek()
        return state.cfg.http.headers if state.cfg is not None else {}

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.stop()  # no new connections, parked ones closed
        self.loop.call_soon_threadsafe(self.loop.stop)
        for pool in (self.render_pool, self.probe_pool):
            pool.close()
        self.auth_gate.close()


class WebServer:
    """An HTTP(S) server for ``routes`` (path -> `Render`) on one or more listen addresses.

    ``ready`` answers ``/-/ready`` (on threads of its own, 503 after `READY_TIMEOUT_S`).
    ``max_requests`` caps requests admitted at once; above it a request waits its turn,
    round-robin per client address, up to `RENDER_WAIT_S`, then 503 (0 = no cap; the
    probe endpoints are exempt); `RENDER_THREADS` of them render at a time, the others wait
    their turn. ``max_connections`` caps connections being served; the
    others (no whole head yet, idle between requests) are parked at the gate, under its
    own budget (`kvsidecar.web.gate.PARKED_MEMORY` and the descriptors), and at its cap
    the one silent longest is closed, so clients that never finish a request cannot lock
    out those that do.
    ``connection_memory`` bounds what open connections may cost together (0 = no bound):
    it caps them at ``connection_memory // TLS_CONNECTION_BYTES`` with TLS on, and
    `PLAIN_CONNECTION_BYTES` each without. ``parked_memory`` bounds the gate's parked
    connections (`kvsidecar.web.gate.PARKED_BYTES` each). ``defer_accept_s``: the kernel
    holds a connection until its first bytes, or about this long (`gate._defer_accept`;
    0: accepted at once).
    ``request_timeout_s`` bounds a TLS handshake, a whole request head (and the idle time
    before it) and the writing of an answer. ``reserved_fds`` are descriptors the rest of
    the process may open later (the daemon's segments): the cap leaves room for them,
    for those open at start and `FD_RESERVE`, under the open-file limit.
    """

    def __init__(
        self,
        routes: Mapping[str, Render],
        listen_addresses: Sequence[str],
        *,
        ready: Callable[[], tuple[bool, str]] = _always_ready,
        web_config: WebConfig | None = None,
        max_requests: int = 40,
        max_connections: int = 1024,
        request_timeout_s: float = 10.0,
        stats: HTTPStats | None = None,
        realm: str = "kvsidecar",
        config_check_interval_s: float = 1.0,
        reserved_fds: int = 0,
        connection_memory: int = CONNECTION_MEMORY,
        parked_memory: int = PARKED_MEMORY,
        listen_sockets: Sequence[socket.socket] = (),
        defer_accept_s: int = DEFER_ACCEPT_S,
    ) -> None:
        # listen_sockets: already listening (systemd's, web/systemd_socket.py), served
        # instead of binding listen_addresses.
        if not listen_addresses and not listen_sockets:
            raise ValueError("at least one listen address is required")
        self._given = list(listen_sockets)
        self._listen = [(a, *parse_listen_address(a)) for a in listen_addresses]
        for path in routes:
            if not path.startswith("/") or path in PROBE_PATHS:
                raise ValueError(
                    f"invalid route path {path!r}: it must start with / and not be "
                    f"{' or '.join(PROBE_PATHS)} (the server answers those itself)"
                )
        if max_requests < 0 or max_connections < 0 or connection_memory < 0:
            raise ValueError(
                "max_requests, max_connections and connection_memory must be >= 0 (0 = unlimited)"
            )
        self.routes = dict(routes)
        self.ready = ready
        self.max_requests = max_requests
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.reserved_fds = reserved_fds
        self.connection_memory = connection_memory
        self.parked_memory = parked_memory
        self.defer_accept_s = defer_accept_s
        self.stats = stats if stats is not None else HTTPStats()
        self.realm = realm
        self._live = LiveConfig(web_config, config_check_interval_s)
        for note in web_config.notes if web_config is not None else ():
            log.warning("web config: %s", note)
        self._sockets: list[socket.socket] = []
        self.fd_room = 1 << 30  # set at start from the open-file limit
        self._front: _Front | None = None
        self._thread: threading.Thread | None = None

    @property
    def tls(self) -> bool:
        return self._live.current().ssl_context is not None

    @property
    def addresses(self) -> list[str]:
        """The bound addresses as host:port ([v6]:port), with real ports for port 0."""
        return [format_address(s.getsockname()) for s in self._sockets]

    def reload(self) -> bool:
        """Re-read the web config file now (SIGHUP); False if the new one is invalid and
        the previous one stays in force."""
        return self._live.reload()

    def start(self) -> None:
        """Bind every address (all or none), then serve them all from one event loop."""
        if self._thread is not None:
            raise RuntimeError("WebServer already started")
        try:
            self._sockets.extend(self._given)
            for text, host, port in self._listen if not self._given else ():
                try:
                    self._sockets.append(bind(host, port))
                except OSError as e:
                    raise OSError(e.errno, f"cannot listen on {text}: {e.strerror or e}") from e
        except BaseException:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
            raise
        self._front = _Front(self, self._connection_cap())
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._front.run,
            args=(self._sockets, started),
            name="kvsidecar-http",
            daemon=True,
        )
        self._thread.start()
        started.wait()
        scheme = "https" if self.tls else "http"
        for address in self.addresses:
            log.info("listening on %s://%s", scheme, address)

    def _connection_cap(self) -> int:
        """max_connections, lowered to what the open-file limit leaves once the
        descriptors open now, ``reserved_fds`` and `FD_RESERVE` are set aside: past the
        limit a segment cannot be opened (a new engine is not served) and accept fails."""
        cap = self.max_connections
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            self.fd_room = 1 << 30
            return cap
        fd_room = max(16, soft - open_fds() - self.reserved_fds - FD_RESERVE)
        # What every connection may hold, parked at the gate or served by the front; a
        # quarter (up to 1,024) is the gate's alone, so served connections at the front's
        # cap never leave the gate (and its probes) without descriptors.
        self.fd_room = fd_room
        fd_room -= min(fd_room // 4, 1024)
        if cap == 0 or cap > fd_room:
            if cap:
                log.warning(
                    "max connections %d lowered to %d by the open-file limit %d "
                    "(%d descriptors kept for segments and %d for the rest)",
                    cap, fd_room, soft, self.reserved_fds, FD_RESERVE,
                )  # fmt: skip
            cap = fd_room
        return cap

    def shutdown(self) -> None:
        """Stop accepting, close the listeners and every connection."""
        if self._front is not None:
            self._front.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        self._front = self._thread = None

    def __enter__(self) -> WebServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _render(self, path: str, request: Request) -> tuple[bytes, str, dict[str, str]]:
        """Runs on a worker thread: the body, its type and encoding headers."""
        body, ctype = self.routes[path](request)
        headers = {"Vary": "Accept-Encoding"}
        if accepts_gzip(request.header("accept-encoding")):
            body = gzip_cached(body)
            headers["Content-Encoding"] = "gzip"
        return body, ctype, headers
