"""A small HTTP/1.1 server for the client that polls hardest: a gateway's endpoint picker
(GET /metrics every 50 ms per picker replica, keep-alive, no Accept header, 1 s timeout).

Why not the main front (`server.py`): the picker's polls must never queue behind
Prometheus renders, bcrypt checks or an attacker on the main port, and each one should
cost microseconds. So this server has its own thread, its own selector and its own
connection budget, and does only what a poll needs: no auth, no compression, no asyncio;
TLS when given one (`tls`: kvsidecar/web/poll_tls.py wraps each accepted socket).
Each listening socket is bound to one `Route` (e.g. one listener per engine rank).

The grammar is the main port's: every head goes through `kvsidecar.web.request.parse_head`
(the same 400/405/414/431/505 verdicts), its end found as the main port's gate finds it.
A picker sends the same head bytes at every poll, so the verdict is kept per distinct
head (a bounded table): a poll's parse is one dictionary lookup. The answer's bytes are
kept per route too (`Route` may hand back the very tuple it handed back before: then the
bytes already built are sent again, nothing rendered).

The budget, by design rather than by attack shape: the picker is a few addresses with
kept-alive connections that each complete a request every second or so; a flood is many
connections that have not (yet) completed one, or one address holding many.
* at most `max_connections` open connections, all listeners together; at the cap a
  newcomer replaces, in this order: the oldest connection that has completed no request;
  else, on the address holding the most connections, the one idle longest. Never one with
  a response in flight. An idle-connection flood so evicts its own connections, not a
  picker's;
* a connection's first byte must come within `head_timeout` of its accept, a request head
  (4 KiB at most, no body) must arrive whole within `head_timeout` of its first byte, and
  a response must be taken by the client within `head_timeout`: a slow or silent client
  holds a place for seconds, not for ever;
* pipelined requests are all answered, in order: at most `_TURN` per connection per turn
  of the loop (every other connection is served in between), and none read while the
  answers already made are not taken (`_MAX_OUT`): the kernel's buffers hold the rest;
* an idle keep-alive connection is closed after `idle_timeout`.

Each connection's bytes go through its socket's ``recv``/``send`` only, so a listener can
hand `_accept` a wrapped (e.g. TLS) socket without the rest changing.

The one request shape a picker sends has a compiled path (`kvsidecar.web._pollfast`, where
it was built): a route may carry a `FastSlot` (``route.fast_slot``) that its owner fills
with an answer and what keeps it current; once a plain-socket connection's head has been
answered from it here and the connection is clean again (nothing buffered either way),
the descriptor is armed with that head, and the loop's wait serves its next polls in C
while they are those exact bytes and the slot is current (one recv, compare, load, send;
no Python object touched), and hands everything else back, disarmed, to the Python path
below. What C served is counted in C: the slot's `served` (`request_counts` adds it), each
connection's `served` and `progress` folded in before the wait returns. Without the
extension (`FAST` is False) every poll takes the Python path, as before.
"""

from __future__ import annotations

import logging
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvsidecar.web.gate import _head_end, _hopeless, _lines
from kvsidecar.web.request import BadRequest, Request, parse_head
from kvsidecar.web.sockets import format_address

try:
    from kvsidecar.web import _pollfast
except ImportError:  # not built (no compiler): every poll takes the Python path
    _pollfast = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from kvsidecar.web.poll_tls import PollTLS

__all__ = ["FAST", "MAX_HEAD", "FastEpoch", "FastSlot", "PollServer", "Route", "response_start"]

log = logging.getLogger(__name__)

# path -> (status, body, content type, extra header lines, each ending in CRLF). Called on
# the server's thread; must not block. Handing back the same tuple object as last time
# means "the same answer": its bytes are sent again as they were built.
Answer = tuple[int, bytes, str, bytes]
Route = Callable[[str], Answer]

MAX_HEAD = 4096  # a picker's GET head is ~150 bytes
_RECV = 8192
_MAX_OUT = 64 * 1024  # answers not yet taken: read no more requests beyond this
_TURN = 16  # pipelined requests answered per connection per turn of the loop
_VERDICTS = 256  # distinct heads whose parse is kept
# The connections' deadlines are swept when the earliest one is due, not on a clock: a
# picker served in C moves no deadline nearer, so its polls wake no Python. At least
# `_SWEEP_MIN` apart (a deadline due at the very instant it is checked does not spin the
# loop), at most `_SWEEP` apart: a deadline nothing here knows of (a timeout attribute
# changed after the start, a path that sets one and does not say so) is met within that.
_SWEEP_MIN = 0.01
_SWEEP = 5.0
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


def response_start(status: int, ctype: str, close: bool = False) -> bytes:
    """A response's bytes up to its Content-Length value: after them come the length,
    CRLF, the route's extra header lines, CRLF and the body."""
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {ctype}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "Content-Length: "
    ).encode("latin-1")


class _PySlot:
    """`FastSlot` where the extension is not built: filled by the route's owner, never
    served from (the Python path re-sends its bytes by the answer's identity)."""

    __slots__ = (
        "advance",
        "advanced",
        "answer",
        "epoch",
        "mm",
        "off",
        "out",
        "seq",
        "served",
        "until",
        "version",
    )  # fmt: skip

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, None)
        self.until, self.served, self.advanced = 0.0, 0, 0
        self.off = self.seq = self.version = 0


class _PyEpoch:
    """`FastEpoch` where the extension is not built: a plain version number."""

    version: int = 0


# One route's answer and what keeps it current: `answer` (a 200 answer tuple the route
# hands back), `out` (its bytes, built here), the 8-byte word at `off` in the buffer `mm`
# still `seq` (unchanged since the answer was made), `epoch.version == version`,
# `time.monotonic() < until`; a moved word or a passed deadline offered to `advance` (see
# kvsidecar/web/_pollfast_api.h). Each poll served from it counts `served += 1`. Its owner
# sets `answer` (and clears `out`) when it has a new one, and `answer = None` when there is
# none. `FastEpoch`: a version read in C (subclass it).
FAST = _pollfast is not None
FastSlot = _pollfast.Slot if _pollfast is not None else _PySlot
FastEpoch = _pollfast.Epoch if _pollfast is not None else _PyEpoch


@dataclass(eq=False)
class _Conn:
    sock: Any  # a socket.socket, or a poll_tls.TLSSocket
    route: Route
    host: str = ""
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytes = b""
    accepted: float = 0.0
    progress: float = 0.0  # monotonic time of the last byte in or out
    head_since: float = 0.0  # first byte of a head not yet complete (0: none pending)
    out_since: float = 0.0  # a response waiting for the client to read it (0: none)
    served: int = 0  # requests answered
    mask: int = selectors.EVENT_READ  # what the selector waits for (0: not registered)
    close_after: bool = False  # Connection: close, or an error answer
    eof: bool = False  # the client sent its last byte: answer what it sent, then close
    # The exact head last answered from `slot` on a plain socket: the compiled path serves
    # these bytes while the slot is current (None: every poll takes the Python path).
    fast_head: bytes | None = None
    slot: object = None

    @property
    def busy(self) -> bool:
        return bool(self.out)


class PollServer:
    """Serve `listeners` ((listening socket, route) pairs) on one background thread;
    `compiled=False` keeps every poll on the Python path (for measuring it)."""

    def __init__(
        self,
        listeners: Sequence[tuple[socket.socket, Route]],
        *,
        max_connections: int = 256,
        head_timeout: float = 2.0,
        idle_timeout: float = 60.0,
        name: str = "kvsidecar-poll-server",
        tls: PollTLS | None = None,
        compiled: bool = True,
    ) -> None:
        self.listeners = list(listeners)
        self.tls = tls
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        self.name = name
        # Read by the daemon's collector from another thread: plain ints in dicts, each
        # update a single bytecode-level store, so a reader never sees a torn count.
        self.requests: dict[int, int] = {}
        self.closed: dict[str, int] = {}  # connections closed by the server, by reason
        self._conns: dict[int, _Conn] = {}
        self._per_host: dict[str, int] = {}
        self._pending: dict[_Conn, None] = {}  # whole heads buffered: served next turn
        self._heads: dict[tuple[int, str, bool], bytes] = {}  # status lines, built once
        self._verdicts: dict[bytes, Request | BadRequest] = {}
        # Per (route, HEAD?): the last answer tuple and its bytes (keep-alive).
        self._built: dict[tuple[Route, bool], tuple[Answer, bytes]] = {}
        self._sel = selectors.DefaultSelector()
        # The compiled path waits on the selector's own epoll descriptor; its table holds
        # the armed descriptors.
        self._fast = (
            _pollfast.Table()
            if compiled and FAST and isinstance(self._sel, selectors.EpollSelector)
            else None
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._next_sweep = 0.0  # monotonic time of the next sweep of the deadlines

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def fast_polls(self) -> int:
        """Polls served by the compiled path so far (the others took the Python path)."""
        slots = (getattr(route, "fast_slot", None) for _, route in self.listeners)
        return sum(slot.served for slot in slots if slot is not None)

    def request_counts(self) -> dict[int, int]:
        """Responses by status: the Python path's and the compiled path's (every answer it
        serves is a slot's 200)."""
        counts = dict(self.requests)
        fast = self.fast_polls
        if fast:
            counts[200] = counts.get(200, 0) + fast
        return counts

    @property
    def addresses(self) -> list[str]:
        """The bound addresses, in listener order (port 0 resolved)."""
        return [format_address(sock.getsockname()) for sock, _ in self.listeners]

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        for sock, route in self.listeners:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, route)
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5)
        for conn in list(self._conns.values()):
            self._close(conn, None)
        for sock, _ in self.listeners:
            sock.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        self._next_sweep = time.monotonic() + _SWEEP
        while not self._stop:
            try:
                wait = 0.0 if self._pending else max(0.0, self._next_sweep - time.monotonic())
                if self._fast is not None:
                    events = self._wait_fast(wait)
                else:
                    events = self._sel.select(timeout=wait)
            except OSError as e:  # EINTR is retried by selectors; anything else: log, go on
                log.warning("%s: select failed: %s", self.name, e)
                time.sleep(0.05)
                continue
            now = time.monotonic()
            for key, mask in events:
                data = key.data
                try:
                    if data is None:
                        self._wake_r.recv(64)
                    elif isinstance(data, _Conn):
                        if mask & selectors.EVENT_WRITE:
                            self._flush(data, now)
                        elif mask & selectors.EVENT_READ:
                            self._read(data, now)
                    else:
                        self._accept(key.fileobj, data, now)  # type: ignore[arg-type]
                except Exception:  # a bug in one connection must not stop the others
                    log.exception("%s: internal error", self.name)
                    if isinstance(data, _Conn):
                        self._close(data, "error")
            if self._pending:
                pending, self._pending = self._pending, {}
                for conn in pending:
                    try:
                        if conn.sock.fileno() >= 0:
                            self._serve(conn, now)
                    except Exception:
                        log.exception("%s: internal error", self.name)
                        self._close(conn, "error")
            if now >= self._next_sweep:
                due = self._sweep(now)
                self._next_sweep = min(max(due, now + _SWEEP_MIN), now + _SWEEP)

    def _wait_fast(self, timeout: float) -> list[tuple[selectors.SelectorKey, int]]:
        """The compiled wait: serves the fast polls itself, and returns what it handed
        back as the selector would (received bytes and unsent answers dealt with here)."""
        back = self._fast.wait(self._sel.fileno(), max(0.0, timeout))  # type: ignore[union-attr]
        ready = []
        now = time.monotonic()
        keys = self._sel.get_map()
        for fd, event, data, rest in back:
            conn = self._conns.get(fd)
            if conn is not None and (rest is not None or data is not None):
                try:
                    if rest is not None:
                        conn.out = rest  # answered, not all taken: the rest waits
                        self._flush(conn, now)
                    else:
                        self._received(conn, data, now)
                except Exception:  # as in the loop: one connection's bug stops no other
                    log.exception("%s: internal error", self.name)
                    self._close(conn, "error")
            elif (key := keys.get(fd)) is not None:
                # As selectors.EpollSelector reads an event.
                mask = 0
                if event & ~select.EPOLLIN:
                    mask |= selectors.EVENT_WRITE
                if event & ~select.EPOLLOUT:
                    mask |= selectors.EVENT_READ
                if mask & key.events:
                    ready.append((key, mask & key.events))
        return ready

    def _accept(self, listener: socket.socket, route: Route, now: float) -> None:
        for _ in range(16):  # a few per turn: a connect flood cannot starve the rest
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: the kernel queue keeps them
                log.warning("%s: accept failed: %s", self.name, e)
                return
            if len(self._conns) >= self.max_connections and not self._make_room():
                self.closed["refused"] = self.closed.get("refused", 0) + 1
                sock.close()
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            host = addr[0] if isinstance(addr, tuple) else str(addr)
            if self.tls is not None:
                # The handshake runs inside its recv; until a request's bytes are
                # decrypted the first-byte deadline (`head_timeout` after accept) holds.
                try:
                    sock = self.tls.wrap(sock)
                except OSError:  # reset before we wrapped it
                    sock.close()
                    continue
            conn = _Conn(sock, route, host, accepted=now, progress=now)
            self._conns[sock.fileno()] = conn
            self._per_host[host] = self._per_host.get(host, 0) + 1
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._watch(conn, now)

    def _make_room(self) -> bool:
        """Close the oldest connection that completed no request, else the one idle
        longest on the address holding the most connections; never one with a response
        in flight. False when every connection is mid-response."""
        idle = [c for c in self._conns.values() if not c.busy]
        if not idle:
            return False
        fresh = [c for c in idle if not c.served]
        if fresh:
            victim = min(fresh, key=lambda c: c.accepted)
        else:
            most = max(self._per_host[c.host] for c in idle)
            victim = min(
                (c for c in idle if self._per_host[c.host] == most), key=lambda c: c.progress
            )
        self._close(victim, "evicted")
        return True

    def _sweep(self, now: float) -> float:
        """Close the connections past a deadline; the earliest deadline of the others."""
        due = float("inf")
        for conn in list(self._conns.values()):
            reason, when = self._deadline(conn, now)
            if reason is not None:
                self._close(conn, reason)
            elif when < due:
                due = when
        return due

    def _deadline(self, conn: _Conn, now: float) -> tuple[str | None, float]:
        """The reason of the first of the connection's deadlines that `now` is past (in
        this order), else None and the earliest of them."""
        head = self.head_timeout
        when = float("inf")
        if conn.out_since:
            if now - conn.out_since > head:
                return "slow_reader", now
            when = conn.out_since + head
        if conn.head_since:
            if now - conn.head_since > head:
                return "slow_head", now
            when = min(when, conn.head_since + head)
        if not conn.served and not conn.out and not conn.inbuf:
            if now - conn.accepted > head:
                return "slow_head", now  # connected, and never sent a byte
            when = min(when, conn.accepted + head)
        if not conn.out and not conn.head_since:
            if now - conn.progress > self.idle_timeout:
                return "idle", now
            when = min(when, conn.progress + self.idle_timeout)
        return None, when

    def _watch(self, conn: _Conn, now: float) -> None:
        """The Python path changed the connection (accepted, read, answered, sent): the
        next sweep comes no later than its deadlines now (the compiled path only moves a
        connection's deadlines later: its polls need none)."""
        when = self._deadline(conn, now)[1]
        if when < self._next_sweep:
            self._next_sweep = when

    # -- one connection -------------------------------------------------------------

    def _read(self, conn: _Conn, now: float) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn, None)
            return
        self._received(conn, data, now)

    def _received(self, conn: _Conn, data: bytes, now: float) -> None:
        if not data:
            if _head_end(conn.inbuf) < 0:
                self._close(conn, None)
                return
            conn.eof = True  # half-closed after pipelining: its requests are answered
            self._set_mask(conn, 0)
            self._serve(conn, now)
            return
        conn.progress = now
        if conn.inbuf:
            conn.inbuf += data
        else:
            conn.inbuf = bytearray(data)
        self._serve(conn, now)

    def _serve(self, conn: _Conn, now: float) -> None:
        """Answer up to `_TURN` whole heads from the buffer, then send."""
        inbuf = conn.inbuf
        for _ in range(_TURN):
            if conn.close_after or len(conn.out) >= _MAX_OUT:
                break
            end = _head_end(inbuf)
            if end < 0:
                break
            head = bytes(inbuf[:end])
            del inbuf[:end]
            self._answer(conn, head)
        if inbuf and not conn.close_after:
            if _head_end(inbuf) < 0:
                if len(inbuf) > MAX_HEAD:
                    inbuf.clear()
                    self._respond(conn, 431, b"request head too large\n", "text/plain", True)
                elif _hopeless(bytes(inbuf[:MAX_HEAD])):
                    inbuf.clear()
                    self._respond(conn, 400, b"not an HTTP request\n", "text/plain", True)
                elif not conn.head_since:
                    conn.head_since = now
            else:
                conn.head_since = 0.0
        else:
            conn.head_since = 0.0
        self._flush(conn, now)

    def _verdict(self, head: bytes) -> Request | BadRequest:
        verdict = self._verdicts.get(head)
        if verdict is None:
            try:
                verdict = parse_head(_lines(head))
            except BadRequest as e:
                verdict = e
            if len(self._verdicts) >= _VERDICTS:
                self._verdicts.clear()  # a client sending ever new heads pays its parses
            self._verdicts[head] = verdict
        return verdict

    def _answer(self, conn: _Conn, head: bytes) -> None:
        conn.served += 1
        request = self._verdict(head)
        if isinstance(request, BadRequest):
            body = f"{request.reason}\n".encode()
            self._respond(conn, request.status, body, "text/plain", close=True)
            return
        if request.has_body:
            # A poll has no body; reading one would let a client hold the thread.
            self._respond(conn, 400, b"a request body is not accepted\n", "text/plain", True)
            return
        close = not request.keep_alive
        head_only = request.method == "HEAD"
        route = conn.route
        try:
            answer = route(request.path)
        except Exception:
            log.exception("%s: route failed for %s", self.name, request.path)
            answer = (500, b"internal error\n", "text/plain", b"")
        if not close:
            key = (route, head_only)
            built = self._built.get(key)
            if built is not None and built[0] is answer:
                self.requests[answer[0]] = self.requests.get(answer[0], 0) + 1
                out = built[1]
                conn.out = conn.out + out if conn.out else out
                if not head_only:
                    self._arm(conn, head, answer, out)
                return
        status, body, ctype, extra = answer
        out = self._respond(conn, status, body, ctype, close, head_only, extra)
        if not close:
            self._built[(route, head_only)] = (answer, out)
            if not head_only:
                self._arm(conn, head, answer, out)

    def _arm(self, conn: _Conn, head: bytes, answer: Answer, out: bytes) -> None:
        """A kept-alive GET answered from its route's slot: the slot's bytes are these,
        and this connection's next polls of the same bytes may take the compiled path
        (plain sockets only: a wrapped one's bytes are not the socket's)."""
        slot = getattr(conn.route, "fast_slot", None)
        if slot is None or slot.answer is not answer:
            return
        slot.out = out
        if self._fast is not None and type(conn.sock) is socket.socket:
            conn.fast_head, conn.slot = head, slot

    def _respond(
        self,
        conn: _Conn,
        status: int,
        body: bytes,
        ctype: str,
        close: bool = False,
        head_only: bool = False,
        extra: bytes = b"",
    ) -> bytes:
        self.requests[status] = self.requests.get(status, 0) + 1
        key = (status, ctype, close)
        start = self._heads.get(key)
        if start is None:
            start = response_start(status, ctype, close)
            if len(self._heads) < 64:
                self._heads[key] = start
        head = b"%s%d\r\n%s\r\n" % (start, len(body), extra)
        out = head if head_only else head + body
        conn.out = conn.out + out if conn.out else out
        conn.close_after = conn.close_after or close
        return out

    def _set_mask(self, conn: _Conn, mask: int) -> None:
        if mask == conn.mask:
            return
        if not mask:
            self._sel.unregister(conn.sock)
        elif not conn.mask:
            self._sel.register(conn.sock, mask, conn)
        else:
            self._sel.modify(conn.sock, mask, conn)
        conn.mask = mask

    def _flush(self, conn: _Conn, now: float) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn, None)
                return
            if sent:
                conn.progress = now
                conn.out = conn.out[sent:]
        if conn.out:
            # Read nothing more until the client takes what it asked for.
            conn.out_since = conn.out_since or now
            self._set_mask(conn, selectors.EVENT_WRITE)
            self._watch(conn, now)
            return
        conn.out_since = 0.0
        if conn.close_after:
            self._close(conn, None)
            return
        if conn.inbuf and _head_end(conn.inbuf) >= 0:
            # More pipelined heads: served next turn, after every other connection.
            self._pending[conn] = None
            self._set_mask(conn, 0)
            self._watch(conn, now)
            return
        if conn.eof:
            self._close(conn, None)
            return
        self._set_mask(conn, selectors.EVENT_READ)
        if self._fast is not None and conn.fast_head is not None and not conn.inbuf:
            # Clean, waiting for its next poll: the compiled path may serve it.
            self._fast.arm(conn.sock.fileno(), conn, conn.fast_head, conn.slot)
        self._watch(conn, now)

    def _close(self, conn: _Conn, reason: str | None) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        if self._fast is not None:
            self._fast.disarm(fd)  # its counts folded; its number may be reused
        if reason is not None:
            self.closed[reason] = self.closed.get(reason, 0) + 1
        self._conns.pop(fd, None)
        self._pending.pop(conn, None)
        left = self._per_host.get(conn.host, 1) - 1
        if left > 0:
            self._per_host[conn.host] = left
        else:
            self._per_host.pop(conn.host, None)
        if conn.mask:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.mask = 0
        conn.sock.close()
