"""The front gate: where connections wait until they have something to say.

Why a gate (issue 31): a connection that has not yet sent a whole request head (or a
whole TLS ClientHello) is the attacker's cheapest weapon. In the asyncio front such a
connection held a transport, a stream reader, a task and a place under a cap sized by
memory; at the cap the front evicted, the attacker reconnected, and the churn cost a
core (1,000 tricklers: /-/healthy p99 150-790 ms). Native servers hold the trickle
goal because a parked connection costs them nothing until a head is complete and
nothing is evicted. This gate does the same in one selector thread of its own:

* A parked connection is a socket and a small record. Its bytes stay in the kernel's
  receive buffer: the gate only *peeks* (MSG_PEEK) to see whether the head (or the
  ClientHello record) is complete, so it holds no buffer and no parser state.
* The cap is in descriptors and in the gate's few hundred bytes per connection
  (`PARKED_BYTES`), not in the 32-64 KB a connection can cost once it is being
  served, so it sits far above what a prober's neighbours hold: 1,000 tricklers fit
  and are never evicted, each closed only at its own head deadline.
* At the cap, the victim is the parked connection that has shown no progress for
  longest (a byte received counts), never one younger than `FRESH_GRACE_S`: a silent
  socket goes before a trickler, and a probe, which sends its head at once, is never
  parked long enough to be one.
* Probes are answered here, on plain HTTP: ``/-/healthy`` at once and ``/-/ready``
  from a check run on a thread of its own (`Readiness`). Connections being served by
  the front (renders, auth, slow readers) live on the other side of the gate, under
  the front's own cap: however many an attacker holds there, the gate and its probes
  are not behind them. With TLS the gate cannot read a head; it parks the connection
  until its ClientHello is whole, refuses a replayed one before any crypto, closes one
  whose client hung up (also while it waits), and hands them on a few at a time as the
  front has handshake places: newest of each address first, addresses whose clients
  completed handshakes lately first.
* Parked connections are watched edge-triggered (their bytes stay unread, so a
  level-triggered watch would report each of them on every wake-up): the gate's work is
  per segment received, not per parked connection.

A complete head that is not a plain probe (a scrape, a request with credentials, a
malformed one, anything TLS) goes to ``hand_off(sock)`` with its bytes still unread,
and the front reads and answers it as before.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import select
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from kvsidecar.web.request import MAX_HEAD_BYTES, BadRequest, parse_head, response_head
from kvsidecar.web.tls_stream import client_random

__all__ = ["FRESH_GRACE_S", "PARKED_BYTES", "Gate", "Readiness"]

log = logging.getLogger(__name__)

HEALTHY_PATH = "/-/healthy"
READY_PATH = "/-/ready"
# What a parked connection costs the daemon, an upper bound of `kvsidecar bench
# parked` (RSS growth per parked connection, 4,000 opened): its socket object, record,
# selector key and dict entries. Its unread bytes are the kernel's (bounded per socket
# by the receive buffer), not the process's.
PARKED_BYTES = 1024
PARKED_MEMORY = 4 << 20  # 4,096 parked connections at most
FRESH_GRACE_S = 1.0  # a new connection's time to send its head before it is evictable
PEEK_CANDIDATES = 8  # young parked connections peeked at the cap for a head before closing one
ACCEPT_BATCH = 64  # accepted per wake-up: the parked connections' events take turns
HELLO_MEMORY = 4096  # recent ClientHello randoms: a repeat is a replay, closed before crypto
# Addresses whose clients completed a TLS handshake lately (at most this many, and within
# `SHOOK_S`): their hellos are handed to the front first (see `Gate.shook`).
SHOOK_MEMORY = 1024
SHOOK_S = 300.0
MAX_TLS_RECORD = 16384 + 2048
DEFER_ACCEPT_S = 1  # TCP_DEFER_ACCEPT: a silent connection is accepted after about this
_PLAIN = "text/plain; charset=utf-8"
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Parked:
    __slots__ = ("born", "deadline", "host", "progress", "seen", "sock")

    def __init__(self, sock: socket.socket, host: str, now: float, timeout: float) -> None:
        self.sock, self.host = sock, host
        self.born = self.progress = now
        self.deadline = now + timeout
        self.seen = 0  # bytes peeked last time: more is progress


class Readiness:
    """``/-/ready``'s check on a thread of its own, so a slow check never holds the gate.
    A probe that arrived at ``t`` is answered with the first result of a check that
    started at or after ``t`` (probes arriving together share one check), or with a 503
    after ``timeout_s``; the gate is woken (``wake``) when a result is posted."""

    def __init__(
        self, check: Callable[[], tuple[bool, str]], wake: Callable[[], None],
        timeout_s: float = 5.0,
    ) -> None:  # fmt: skip
        self.check, self.wake, self.timeout_s = check, wake, timeout_s
        self.result: tuple[float, bool, str] | None = None  # (check started, ok, reason)
        self._ask = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvsidecar-ready", daemon=True)
        self._thread.start()

    def since(self, t: float) -> tuple[bool, str] | None:
        """The result of a check started at or after ``t``, or None (one is asked for)."""
        r = self.result
        if r is not None and r[0] >= t:
            return r[1], r[2]
        self._ask.set()
        return None

    def _run(self) -> None:
        while True:
            self._ask.wait()
            if self._stop:
                return
            self._ask.clear()  # a probe arriving from now on waits for the next check
            started = time.monotonic()
            try:
                ok, reason = self.check()
            except Exception as e:
                log.exception("readiness check failed")
                ok, reason = False, f"readiness check failed: {e}"
            self.result = (started, ok, reason)
            self.wake()

    def close(self) -> None:
        self._stop = True
        self._ask.set()


class Gate:
    """Accepts on ``sockets`` and parks each connection until its first request head (or
    TLS record) is whole; see the module docstring. ``tls``: whether TLS is on (a
    reload cannot change it); ``headers()`` gives the web config's extra headers;
    ``observe(route, status, seconds)`` and ``rejected()`` count what the gate did;
    ``room()`` gives how many more descriptors connections may hold now, the front's
    included (the gate's cap is the smaller of that and its memory budget);
    ``front_room()`` how many more the front can take now: a complete head waits here
    (in arrival order, off the selector, its deadline still running) until it can, so
    a burst of scrapes queues at no cost instead of making the front close others.
    The front calls `arrived` for each connection it took and `wake` when one left."""

    def __init__(
        self,
        sockets: Sequence[socket.socket],
        *,
        hand_off: Callable[[socket.socket], None],
        tls: bool,
        headers: Callable[[], Mapping[str, str]],
        ready: Callable[[], tuple[bool, str]],
        observe: Callable[[str, int, float], None],
        rejected: Callable[[], None],
        room: Callable[[], int],
        front_room: Callable[[], int],
        head_timeout_s: float,
        parked_memory: int = PARKED_MEMORY,
        defer_accept_s: int = DEFER_ACCEPT_S,
    ) -> None:
        self.listeners = list(sockets)
        self.defer_accept_s = defer_accept_s
        self.hand_off, self.tls, self.headers = hand_off, tls, headers
        self.observe, self.rejected, self.room = observe, rejected, room
        self.front_room = front_room
        # Complete heads waiting for room in the front: per client address, oldest first,
        # the addresses taking turns (the dict order is the round), so a flood from a few
        # addresses delays a login from another by one turn per address, not per connection.
        self.queued: OrderedDict[str, collections.deque[_Parked]] = OrderedDict()
        self.queued_count = 0
        self.queued_expiry = 0.0
        self.sent = 0  # handed to the front (written by the gate only)
        self.taken = 0  # of those, taken by the front (written by the front only)
        self.head_timeout_s = head_timeout_s
        self.max_parked = max(16, parked_memory // PARKED_BYTES)
        self.sel = selectors.DefaultSelector()
        # Parked connections are watched edge-triggered, in an epoll of their own: their
        # bytes stay unread (peeked), so a level-triggered watch reports every one of
        # them on every wake-up, and the gate spun a core peeking 1,000 tricklers over
        # and over. An edge comes with each new segment (and the FIN): a wake-up per byte
        # a trickler sends, none for the bytes it sent before.
        self.parked_ep = select.epoll()
        self.parked_fds: dict[int, socket.socket] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.readiness = Readiness(ready, self._wake)
        # Parked connections twice over: by deadline (accept order; a re-parked keep-alive
        # goes to the end with a new deadline) and by last progress (the victim order).
        self.by_deadline: OrderedDict[socket.socket, _Parked] = OrderedDict()
        self.by_progress: OrderedDict[socket.socket, None] = OrderedDict()
        # Parked connections per client address, oldest first: the fallback victim order.
        self.by_host: dict[str, OrderedDict[socket.socket, None]] = {}
        self.awaiting_ready: list[tuple[_Parked, bool, bool, float]] = []
        self.hellos: OrderedDict[bytes, None] = OrderedDict()
        self.adopted: collections.deque[tuple[socket.socket, str]] = collections.deque()
        # Complete heads the front had no room for when they arrived (it counts as room
        # the connections it may close, read here from another thread, and one of those
        # can have become busy meanwhile): queued again first of their address, and none
        # handed on until the front next says a connection left (`wake`).
        self.returned: collections.deque[tuple[socket.socket, str]] = collections.deque()
        self.front_full = False
        # TLS: complete ClientHellos waiting for the front are watched for their client
        # hanging up (EPOLLRDHUP alone: their unread hello would keep a readable watch
        # firing). A TLS client never shuts its side before its handshake is done, so a
        # hang-up means nobody will read the server's flight: closed here, at no cost,
        # instead of queueing a handshake for nobody.
        self.hangups = select.epoll() if tls else None
        self.watched: dict[int, _Parked] = {}
        # TLS: addresses whose clients completed a handshake lately (host -> when), told
        # by the front (`shook`), and those of them with hellos queued, in their own round
        # served before the others'. A hello's bytes cannot tell a kubelet from an
        # attacker on the same node; what its address did can: clients that flood hellos
        # and never finish (silent or gone) do not take turns from one that finishes.
        self.shook_hosts: OrderedDict[str, float] = OrderedDict()
        self.shook_news: collections.deque[tuple[str, float]] = collections.deque()
        self.ranked: OrderedDict[str, None] = OrderedDict()
        self.spare = _take_spare()
        self.closed = False
        self.parked_peak = 0
        self.evicted = 0
        self._thread = threading.Thread(target=self._run, name="kvsidecar-gate", daemon=True)

    # -- lifecycle --

    def start(self) -> None:
        for sock in self.listeners:
            sock.setblocking(False)
            _defer_accept(sock, self.defer_accept_s)
            self.sel.register(sock, selectors.EVENT_READ, self._accept)
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        self.sel.register(self.parked_ep.fileno(), selectors.EVENT_READ, self._parked_events)
        if self.hangups is not None:
            self.sel.register(self.hangups.fileno(), selectors.EVENT_READ, self._hung_up_queued)
        self._thread.start()

    def stop(self) -> None:
        self.closed = True
        self._wake()
        self._thread.join(timeout=5)
        self.readiness.close()

    def adopt(self, sock: socket.socket, host: str) -> None:
        """Park ``sock`` again (any thread): a keep-alive connection the front answered."""
        self.adopted.append((sock, host))
        self._wake()

    def give_back(self, sock: socket.socket, host: str) -> None:
        """Queue ``sock``'s complete head here again (front thread): the front found itself
        full when it arrived, and it closes no request owed its answer to make room."""
        self.front_full = True
        self.returned.append((sock, host))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # full (a wake is pending anyway) or closed at shutdown

    def _drain_wake(self, _sock: socket.socket) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    @property
    def parked(self) -> int:
        return len(self.by_deadline) + self.queued_count + len(self.awaiting_ready)

    def _run(self) -> None:
        try:
            while not self.closed:
                now = time.monotonic()
                timeout = self._expire(now)
                for key, _ in self.sel.select(timeout):
                    key.data(key.fileobj)
                while self.adopted:
                    self._admit(*self.adopted.popleft())
                while self.returned:
                    self._requeue(*self.returned.popleft())
                while self.shook_news:
                    self._note_shook(*self.shook_news.popleft())
                self._hand_queued(time.monotonic())
                self._answer_ready(time.monotonic())
        except Exception:  # a bug: the front must not die silently
            log.exception("http: the gate failed")
        finally:
            for parked in list(self.by_deadline.values()):
                self._close(parked)
            for parked, *_ in self.awaiting_ready:
                parked.sock.close()
            for queue in self.queued.values():
                for parked in queue:
                    parked.sock.close()
            while self.adopted:
                self.adopted.popleft()[0].close()
            while self.returned:
                self.returned.popleft()[0].close()
            for key in list(self.sel.get_map().values()):  # the hang-up watch's fd included
                self.sel.unregister(key.fileobj)
            self.sel.close()
            self._wake_r.close()
            self._wake_w.close()
            self.parked_ep.close()
            if self.hangups is not None:
                self.hangups.close()
            if self.spare >= 0:
                os.close(self.spare)
                self.spare = -1

    # -- accepting --

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _EXHAUSTED:
                    self._at_fd_limit(listener)
                    return
                continue  # ECONNABORTED and the like: that client is gone, not us
            self._admit(sock, str(address[0]) if isinstance(address, tuple) else "")

    def _at_fd_limit(self, listener: socket.socket) -> None:
        # One descriptor is kept spare, as nginx, libuv and Go do: at the limit it is
        # released, the waiting connection accepted, and room made by closing a victim
        # (or, with none, the newcomer), so probes do not wait behind the limit.
        self.rejected()
        if self.spare < 0:
            return
        os.close(self.spare)
        self.spare = -1
        try:
            sock, address = listener.accept()
        except OSError:
            sock = None
        if sock is not None:
            host = str(address[0]) if isinstance(address, tuple) else ""
            sock.setblocking(False)
            if self._make_room(time.monotonic(), host, _has_head(sock)):
                self._admit(sock, host)
            else:
                sock.close()
        self.spare = _take_spare()

    def _admit(self, sock: socket.socket, host: str) -> None:
        now = time.monotonic()
        sock.setblocking(False)
        if self._full() and not self._make_room(now, host, _has_head(sock)):
            self.rejected()
            sock.close()  # everyone parked is new and silent: the newcomer is refused
            return
        parked = _Parked(sock, host, now, self.head_timeout_s)
        self._park(parked)
        self.parked_peak = max(self.parked_peak, self.parked)

    def _park(self, parked: _Parked) -> None:
        self.by_deadline[parked.sock] = parked
        self.by_progress[parked.sock] = None
        self.by_host.setdefault(parked.host, OrderedDict())[parked.sock] = None
        fd = parked.sock.fileno()
        self.parked_ep.register(fd, select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET)
        self.parked_fds[fd] = parked.sock  # bytes already there are reported once

    def _unpark(self, parked: _Parked) -> None:
        if self.by_deadline.pop(parked.sock, None) is not None:
            del self.by_progress[parked.sock]
            mine = self.by_host[parked.host]
            del mine[parked.sock]
            if not mine:
                del self.by_host[parked.host]
            fd = parked.sock.fileno()
            del self.parked_fds[fd]
            self.parked_ep.unregister(fd)

    def _close(self, parked: _Parked) -> None:
        self._unpark(parked)
        if parked.seen:
            _peek(parked.sock, 0)  # unread bytes would turn our FIN into a RST
        parked.sock.close()

    def _full(self) -> bool:
        return self.parked >= min(self.max_parked, max(16, self.room()))

    def _make_room(self, now: float, host: str, has_head: bool) -> bool:
        """Close a victim for a newcomer (`_victim`); False if there is none and no room."""
        victim = self._victim(now, host, has_head)
        if victim is None:
            return not self._full()
        self._evict(victim)
        return True

    def _victim(self, now: float, host: str, has_head: bool) -> _Parked | None:
        """Who makes room for a newcomer from ``host`` (``has_head``: its whole request
        head is already here). The parked connection silent for longest, if it had its
        grace to speak; else (an attacker reconnecting so fast that everyone parked is
        young) the oldest head-less connection of the address parking the most, when that
        address is the newcomer's own (it gives up its oldest for its newest, so a
        reconnecting flood from a probe's own address closes its own connections, not
        the probe), parks more than the newcomer's would, or the newcomer brought a
        whole head (a request never goes for a connection that has sent none); else the
        oldest complete head of the address with the most waiting for the front
        (refused with a 503: nothing was done for it yet, and a probe, answered here,
        is never one). None: the newcomer, young and head-less, is refused."""
        for sock in self.by_progress:
            parked = self.by_deadline[sock]
            if now - parked.born >= FRESH_GRACE_S:
                return parked
            break  # the least recently progressed is also young: so is everyone
        if self.by_host:
            heaviest_host = max(self.by_host, key=lambda h: len(self.by_host[h]))
            heaviest = self.by_host[heaviest_host]
            mine = len(self.by_host.get(host, ()))
            if has_head or heaviest_host == host or len(heaviest) > mine + 1:
                return self._silent_oldest(heaviest)
        if self.queued:
            heaviest_queue = max(self.queued.values(), key=len)
            return heaviest_queue[0]
        return None

    def _silent_oldest(self, conns: OrderedDict[socket.socket, None]) -> _Parked | None:
        """The oldest of ``conns`` that has sent nothing yet, its bytes peeked now: one
        that has (a probe whose head arrived since its readable edge, not yet handled)
        is handled at once instead, answered or handed on, never closed unheard. None
        when that made room; the oldest if all `PEEK_CANDIDATES` looked at spoke."""
        for sock in list(itertools.islice(conns, PEEK_CANDIDATES)):
            parked = self.by_deadline.get(sock)
            if parked is None:
                continue
            if _peek(sock) is None:
                return parked
            self._readable(sock)
            if not self._full():
                return None
        return next((self.by_deadline[s] for s in conns), None)

    def _evict(self, parked: _Parked) -> None:
        self.evicted += 1
        self.rejected()
        queue = self.queued.get(parked.host)
        if queue and queue[0] is parked:
            self._dequeue(parked, queue)
            self._refuse(parked)
            return
        self._close(parked)

    def _refuse(self, parked: _Parked) -> None:
        """Close a complete head the front never took, told why: a request (credentials
        included) is answered or refused with a status, never dropped unanswered. TLS:
        only its hello is here, nothing can be said before a handshake."""
        if not self.tls:
            body = b"503 too many connections, try again later\n"
            self._send_headers(parked, 503, body, {"Retry-After": "1"})
            self.observe("other", 503, 0.0)
        _peek(parked.sock, 0)  # the unread head would turn our FIN into a RST
        parked.sock.close()

    def _expire(self, now: float) -> float | None:
        """Close connections past their head deadline; the select timeout until the next."""
        while self.by_deadline:
            parked = next(iter(self.by_deadline.values()))
            if parked.deadline > now:
                wait = parked.deadline - now
                return min(wait, 0.1) if self.awaiting_ready or self.queued else wait
            self._timed_out(parked)
        return 0.1 if self.awaiting_ready or self.queued else None

    def _timed_out(self, parked: _Parked) -> None:
        data = _peek(parked.sock)
        if data and b"\n" in data and not self.tls:
            # A whole request line, then too slow: told so (Go and nginx answer 408).
            self._send(parked, 408, b"408 request head not received in time\n", True, False)
            self.observe("other", 408, 0.0)
        self._close(parked)

    # -- a parked connection spoke --

    def _parked_events(self, _fd: int) -> None:
        for fd, _ in self.parked_ep.poll(0, ACCEPT_BATCH * 4):
            sock = self.parked_fds.get(fd)
            if sock is not None:
                self._readable(sock)

    def _readable(self, sock: socket.socket) -> None:
        parked = self.by_deadline.get(sock)
        if parked is None:
            return
        data = _peek(sock)
        if data is None:
            return  # a spurious wake-up
        if not data:
            self._close(parked)  # hung up (or reset) before a whole head
            return
        if len(data) > parked.seen:
            parked.seen = len(data)
            parked.progress = time.monotonic()
            self.by_progress.move_to_end(sock)
        if self.tls:
            self._tls_readable(parked, data)
        else:
            self._plain_readable(parked, data)

    def _tls_readable(self, parked: _Parked, data: bytes) -> None:
        if len(data) < 5:
            return
        length = int.from_bytes(data[3:5], "big")
        if data[0] == 0x16 and length <= MAX_TLS_RECORD and len(data) < 5 + length:
            return  # the ClientHello is not whole yet: stay parked, no OpenSSL state
        if _shut_down(parked.sock):
            self._close(parked)  # sent its hello and hung up: a handshake for nobody
            return
        if not self._fresh_hello(data[: 5 + length]):
            self._close(parked)  # a replayed hello costs the attacker nothing, us a signature
            return
        self._pass(parked)

    def _plain_readable(self, parked: _Parked, data: bytes) -> None:
        end = _head_end(data)
        if end < 0:
            if _hopeless(data):
                close, head_only = True, False
                body = b"not an HTTP/1.x request head"
                self._probe_answered(parked, "other", 400, body, close, head_only, (1, 1))
                return
            if len(data) > MAX_HEAD_BYTES or _shut_down(parked.sock):
                # Too long, or all the client will send: the front answers it with its
                # own rules (414/431/400).
                self._pass(parked)
            return
        try:
            request = parse_head(_lines(data[:end]))
        except BadRequest:
            self._pass(parked)  # the front answers it (and logs it, throttled)
            return
        if request.path not in (HEALTHY_PATH, READY_PATH) or request.has_body:
            self._pass(parked)
            return
        _consume(parked.sock, end)
        head_only = request.method == "HEAD"
        close = not request.keep_alive
        if request.path == HEALTHY_PATH:
            self._probe_answered(
                parked, HEALTHY_PATH, 200, b"OK", close, head_only, request.version
            )
            return
        now = time.monotonic()
        verdict = self.readiness.since(now)
        if verdict is None:  # asked: answered when the check posts its result
            if len(self.awaiting_ready) >= self.max_parked:
                verdict = False, "not ready: too many readiness probes waiting"
            else:
                self._unpark(parked)  # out of the deadline and victim orders meanwhile
                self.awaiting_ready.append((parked, close, head_only, now))
                return
        ok, reason = verdict
        body = (reason or ("OK" if ok else "not ready")).encode()
        status = 200 if ok else 503
        self._probe_answered(parked, READY_PATH, status, body, close, head_only, request.version)

    def _answer_ready(self, now: float) -> None:
        if not self.awaiting_ready:
            return
        still = []
        for parked, close, head_only, t0 in self.awaiting_ready:
            verdict = self.readiness.since(t0)
            if verdict is None and now - t0 > self.readiness.timeout_s:
                timeout = self.readiness.timeout_s
                verdict = False, f"not ready: readiness check took over {timeout:g} s"
            if verdict is None:
                still.append((parked, close, head_only, t0))
                continue
            ok, reason = verdict
            body = (reason or ("OK" if ok else "not ready")).encode()
            self._park(parked)
            sent = self._send(parked, 200 if ok else 503, body, close, head_only)
            self.observe(READY_PATH, 200 if ok else 503, now - t0)
            self._after_answer(parked, close or not sent)
        self.awaiting_ready = still

    def _probe_answered(
        self, parked: _Parked, route: str, status: int, body: bytes, close: bool,
        head_only: bool, version: tuple[int, int],
    ) -> None:  # fmt: skip
        t0 = time.monotonic()
        sent = self._send(parked, status, body, close, head_only, version)
        self.observe(route, status, time.monotonic() - t0)
        self._after_answer(parked, close or not sent)

    def _after_answer(self, parked: _Parked, close: bool) -> None:
        if close:
            self._close(parked)
            return
        # Keep-alive: parked again with a fresh deadline for its next head.
        self._unpark(parked)
        now = time.monotonic()
        parked.born = parked.progress = now
        parked.deadline = now + self.head_timeout_s
        parked.seen = 0
        self._park(parked)

    def _send(
        self, parked: _Parked, status: int, body: bytes, close: bool, head_only: bool,
        version: tuple[int, int] = (1, 1),
    ) -> bool:  # fmt: skip
        return self._send_headers(parked, status, body, {}, close, head_only, version)

    def _send_headers(
        self, parked: _Parked, status: int, body: bytes, headers: Mapping[str, str],
        close: bool = True, head_only: bool = False, version: tuple[int, int] = (1, 1),
    ) -> bool:  # fmt: skip
        headers = {**self.headers(), **headers}
        if version < (1, 1) and not close:
            headers["Connection"] = "keep-alive"
        items = [("Content-Type", _PLAIN), ("Content-Length", str(len(body))), *headers.items()]
        payload = response_head(status, items, close=close) + (b"" if head_only else body)
        try:
            # A probe's answer is a few hundred bytes: it fits an empty send buffer, and a
            # client that left its previous answer unread is not worth waiting for.
            return parked.sock.send(payload) == len(payload)
        except OSError:
            return False

    def arrived(self) -> None:
        """The front took a connection the gate handed it (front thread)."""
        self.taken += 1

    def wake(self) -> None:
        """The front has room again (any thread): hand over what waits."""
        self.front_full = False
        if self.queued or self.returned:
            self._wake()

    def _pass(self, parked: _Parked) -> None:
        self._unpark(parked)
        self.queued.setdefault(parked.host, collections.deque()).append(parked)
        self._enqueued(parked)

    def _requeue(self, sock: socket.socket, host: str) -> None:
        """A head the front gave back (`give_back`): first of its address again, its
        address first in the round (it had its turn), with a new head deadline."""
        parked = _Parked(sock, host, time.monotonic(), self.head_timeout_s)
        self.queued.setdefault(host, collections.deque()).appendleft(parked)
        self.queued.move_to_end(host, last=False)
        self._enqueued(parked)

    def _enqueued(self, parked: _Parked) -> None:
        self.queued_count += 1
        if self.hangups is not None:
            if self._ranked_host(parked.host, time.monotonic()):
                self.ranked[parked.host] = None
            fd = parked.sock.fileno()
            self.hangups.register(fd, select.EPOLLRDHUP)  # EPOLLHUP and EPOLLERR implied
            self.watched[fd] = parked
        self._hand_queued(time.monotonic())

    def shook(self, host: str) -> None:
        """A client from ``host`` completed a TLS handshake (front thread)."""
        self.shook_news.append((host, time.monotonic()))
        self._wake()

    def _note_shook(self, host: str, when: float) -> None:
        self.shook_hosts[host] = when
        self.shook_hosts.move_to_end(host)
        if len(self.shook_hosts) > SHOOK_MEMORY:
            self.shook_hosts.popitem(last=False)
        if host in self.queued:
            self.ranked[host] = None

    def _ranked_host(self, host: str, now: float) -> bool:
        when = self.shook_hosts.get(host)
        return when is not None and now - when < SHOOK_S

    def _dequeue(self, parked: _Parked, queue: collections.deque[_Parked]) -> None:
        """Take ``parked`` out of its address's ``queue`` (and out of the hang-up watch)."""
        if queue[0] is parked:
            queue.popleft()
        elif queue[-1] is parked:
            queue.pop()
        else:
            queue.remove(parked)
        self.queued_count -= 1
        if not queue:
            del self.queued[parked.host]
            self.ranked.pop(parked.host, None)
        if self.hangups is not None and self.watched.pop(parked.sock.fileno(), None):
            self.hangups.unregister(parked.sock.fileno())

    def _hung_up_queued(self, _fd: int) -> None:
        """TLS: clients of queued ClientHellos that hung up (see ``hangups``): closed."""
        for fd, _ in self.hangups.poll(0, 256) if self.hangups is not None else ():
            parked = self.watched.get(fd)
            queue = self.queued.get(parked.host) if parked is not None else None
            if parked is None or queue is None:
                continue
            self._dequeue(parked, queue)
            parked.sock.close()

    def _hand_queued(self, now: float) -> None:
        if not self.queued:
            return
        if now >= self.queued_expiry:  # a scan of every address: a few times a second
            self.queued_expiry = now + 0.1
            for queue in list(self.queued.values()):
                while queue and queue[0].deadline <= now:
                    self.rejected()
                    expired = queue[0]
                    self._dequeue(expired, queue)  # waited its whole deadline for the front
                    self._refuse(expired)
        room = 0 if self.front_full else self.front_room() - (self.sent - self.taken)
        while self.queued and room > 0:
            # TLS: the round of addresses that completed handshakes lately goes first.
            host = next(iter(self.ranked or self.queued))
            queue = self.queued[host]
            # TLS: the newest hello of the address first. Its client has the most of its
            # timeout left (a kubelet's is 1 s); the oldest, whose clients likely gave up
            # already, are the ones evicted at the cap and expired at their deadline.
            parked = queue[-1] if self.tls else queue[0]
            self._dequeue(parked, queue)
            if queue:
                self.queued.move_to_end(host)  # to the back of the round
                if host in self.ranked:
                    self.ranked.move_to_end(host)
            self.sent += 1
            room -= 1
            self.hand_off(parked.sock)

    def _fresh_hello(self, record: bytes) -> bool:
        random = client_random(record)
        if not random:
            return True  # not a hello: OpenSSL answers it with an alert
        if random in self.hellos:
            return False
        self.hellos[random] = None
        if len(self.hellos) > HELLO_MEMORY:
            self.hellos.popitem(last=False)
        return True


def _defer_accept(listener: socket.socket, seconds: int) -> None:
    """Have the kernel hold a connection until its first bytes arrive (or ``seconds``;
    0: the listener is left as it is): every client of this port speaks first (a request
    head, a ClientHello). Connections that stay silent wait in the kernel's SYN queue, at
    no descriptor and no work of ours, and come to accept only after about ``seconds`` (a
    SYN-ACK retransmitted, answered); closed, they come back at most that often. Without
    it, 1,000 silent connections from a probe's own address, reconnecting as fast as the
    gate closed them, had it accept and close 8,000-23,000 a second, the probe queued
    among them."""
    if seconds and listener.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, seconds)


def _take_spare() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1  # at the limit right now: taken back later


def _peek(sock: socket.socket, flags: int = socket.MSG_PEEK) -> bytes | None:
    """What the socket holds, unread; b"" once the client hung up; None if nothing yet."""
    try:
        return sock.recv(MAX_HEAD_BYTES + 1, flags)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _has_head(sock: socket.socket) -> bool:
    """A newcomer's whole request head is already in its receive buffer."""
    data = _peek(sock)
    return bool(data) and _head_end(data) >= 0


def _shut_down(sock: socket.socket) -> bool:
    """The client shut its sending side (or reset): what is buffered is all it sends."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def _head_end(data: bytes) -> int:
    """Where the head ends (after its empty line), or -1 if it has not yet. A line may end
    in CRLF or a bare LF (RFC 9112 2.2), so the empty line is LF CRLF or LF LF after the
    last field: "\\r\\n\\r\\n" is the first of these seen one byte late; a head ending in
    LF CRLF waited for its deadline when only CRLF CRLF and LF LF were looked for."""
    ends = [i + n for i, n in ((data.find(b"\n\r\n"), 3), (data.find(b"\n\n"), 2)) if i >= 0]
    return min(ends) if ends else -1


_METHOD_BYTES = frozenset(
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)
_NEVER_IN_A_HEAD = frozenset(range(0x20)) - {0x09, 0x0A, 0x0D} | {0x7F}


def _hopeless(data: bytes) -> bool:
    """The bytes so far can begin no request head, whatever follows: a method that is not a
    token (a TLS ClientHello sent to the plain port starts 0x16), a request line that ends
    before its first space, or a control byte no head may hold (`parse_head` would refuse
    each). Answered 400 at once: waiting for a head end that may never come held such a
    client until its deadline when it kept its side open."""
    if any(b in _NEVER_IN_A_HEAD for b in data):
        return True
    rest = data.lstrip(b"\r\n")  # a few empty lines before a request are allowed
    method = rest.split(b" ", 1)[0]
    if len(method) < len(rest):  # the method is complete: it must be one token
        return not method or any(b not in _METHOD_BYTES for b in method)
    return any(b not in _METHOD_BYTES for b in rest.rstrip(b"\r\n")) or b"\n" in rest


def _lines(head: bytes) -> list[bytes]:
    """A whole head (with its empty line) as `parse_head` takes it: lines with their
    ends, without the empty one."""
    lines = head.split(b"\n")[:-1]
    return [line + b"\n" for line in lines if line not in (b"", b"\r")]


def _consume(sock: socket.socket, n: int) -> None:
    """Take the answered head out of the receive buffer (it is there: we peeked it)."""
    while n > 0:
        try:
            got = len(sock.recv(n))
        except OSError:
            return
        if not got:
            return
        n -= got
