"""A small HTTP/1.1 server for the client that polls hardest: a gateway's endpoint picker
(GET /metrics every 50 ms per picker replica, keep-alive, no Accept header, 1 s timeout).

Why not the main front (`server.py`): the picker's polls must never queue behind
Prometheus renders, bcrypt checks or an attacker on the main port, and each one should
cost microseconds. So this server has its own thread, its own selector and its own
connection budget, and does only what a poll needs: no auth, no compression, no asyncio;
TLS when given one (`tls`: kvsidecar/web/poll_tls.py wraps each accepted socket).
Each listening socket is bound to one `Route` (e.g. one listener per engine rank).

The budget, by design rather than by attack shape:
* at most `max_connections` open connections, all listeners together; at the cap a
  newcomer replaces the connection that has shown no progress for longest (an idle
  keep-alive one, or one still sending its head), never one with a response in flight;
* a request head (4 KiB at most, no body) must arrive whole within `head_timeout` of its
  first byte, and a response must be taken by the client within `head_timeout`: a slow
  client holds a place for seconds, not for ever;
* an idle keep-alive connection is closed after `idle_timeout`.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvsidecar.web.sockets import format_address

if TYPE_CHECKING:
    from kvsidecar.web.poll_tls import PollTLS

__all__ = ["MAX_HEAD", "PollServer", "Route"]

log = logging.getLogger(__name__)

# path -> (status, body, content type, extra header lines, each ending in CRLF). Called on
# the server's thread; must not block.
Route = Callable[[str], tuple[int, bytes, str, bytes]]

MAX_HEAD = 4096  # a picker's GET head is ~150 bytes
_RECV = 8192
_MAX_OUT = 64 * 1024  # pipelined answers not yet taken: stop reading beyond this
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def _header(low_headers: bytes, name: bytes) -> bytes:
    """The value of header `name` (lowercase, with its colon) in lowercased header lines."""
    at = low_headers.find(name)
    if at < 0 or (at > 0 and low_headers[at - 1 : at] != b"\n"):
        return b""
    end = low_headers.find(b"\r\n", at)
    return low_headers[at + len(name) : end if end >= 0 else None].strip()


@dataclass(eq=False)
class _Conn:
    sock: Any  # a socket.socket, or a poll_tls.TLSSocket
    route: Route
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytes = b""
    progress: float = 0.0  # monotonic time of the last byte in or out
    head_since: float = 0.0  # first byte of a head not yet complete (0: none pending)
    out_since: float = 0.0  # a response waiting for the client to read it (0: none)
    close_after: bool = False  # Connection: close, or an error answer

    @property
    def busy(self) -> bool:
        return bool(self.out)


class PollServer:
    """Serve `listeners` ((listening socket, route) pairs) on one background thread."""

    def __init__(
        self,
        listeners: Sequence[tuple[socket.socket, Route]],
        *,
        max_connections: int = 256,
        head_timeout: float = 2.0,
        idle_timeout: float = 60.0,
        name: str = "kvsidecar-poll-server",
        tls: PollTLS | None = None,
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
        self._heads: dict[tuple[int, str, bool], bytes] = {}  # status lines, built once
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def connections(self) -> int:
        return len(self._conns)

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
        last_sweep = time.monotonic()
        while not self._stop:
            try:
                events = self._sel.select(timeout=0.25)
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
                        if mask & selectors.EVENT_READ and data.sock.fileno() >= 0:
                            self._read(data, now)
                    else:
                        self._accept(key.fileobj, data, now)  # type: ignore[arg-type]
                except Exception:  # a bug in one connection must not stop the others
                    log.exception("%s: internal error", self.name)
                    if isinstance(data, _Conn):
                        self._close(data, "error")
            if now - last_sweep >= 0.25:
                last_sweep = now
                self._sweep(now)

    def _accept(self, listener: socket.socket, route: Route, now: float) -> None:
        for _ in range(16):  # a few per turn: a connect flood cannot starve the rest
            try:
                sock, _addr = listener.accept()
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
            conn = _Conn(sock, route, progress=now)
            if self.tls is not None:
                try:
                    conn.sock = self.tls.wrap(sock)
                except OSError:  # reset before we wrapped it
                    sock.close()
                    continue
                conn.head_since = now  # handshake and first head within head_timeout
            self._conns[conn.sock.fileno()] = conn
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def _make_room(self) -> bool:
        """Close the connection that has shown no progress for longest (none with a
        response in flight); False when every connection is mid-response."""
        victim = min(
            (c for c in self._conns.values() if not c.busy),
            key=lambda c: c.progress,
            default=None,
        )
        if victim is None:
            return False
        self._close(victim, "evicted")
        return True

    def _sweep(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if conn.out_since and now - conn.out_since > self.head_timeout:
                self._close(conn, "slow_reader")
            elif conn.head_since and now - conn.head_since > self.head_timeout:
                self._close(conn, "slow_head")
            elif not conn.out and not conn.head_since and now - conn.progress > self.idle_timeout:
                self._close(conn, "idle")

    # -- one connection -------------------------------------------------------------

    def _read(self, conn: _Conn, now: float) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn, None)
            return
        if not data:
            self._close(conn, None)
            return
        conn.progress = now
        if not conn.inbuf and data.endswith(b"\r\n\r\n") and data.count(b"\r\n\r\n") == 1:
            # The usual poll: one whole head in one segment, nothing buffered.
            conn.head_since = 0.0
            self._answer(conn, data[:-4])
            self._flush(conn, now)
            return
        conn.inbuf += data
        while not conn.close_after and len(conn.out) < _MAX_OUT:
            end = conn.inbuf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = bytes(conn.inbuf[:end])
            del conn.inbuf[: end + 4]
            self._answer(conn, head)
        if conn.inbuf and not conn.close_after:
            if len(conn.inbuf) > MAX_HEAD:
                conn.inbuf.clear()
                self._respond(conn, 431, b"request head too large\n", "text/plain", close=True)
            elif not conn.head_since:
                conn.head_since = now
        else:
            conn.head_since = 0.0
        self._flush(conn, now)

    def _answer(self, conn: _Conn, head: bytes) -> None:
        line, _, headers = head.partition(b"\r\n")
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._respond(conn, 400, b"bad request line\n", "text/plain", close=True)
            return
        method, target, version = parts
        close = version == b"HTTP/1.0"
        low = headers.lower()
        # Most polls carry neither header: one search each instead of parsing every line.
        if b"connection:" in low:
            v = _header(low, b"connection:")
            close = v == b"close" or (close and v != b"keep-alive")
        if b"transfer-encoding:" in low or _header(low, b"content-length:") not in (b"", b"0"):
            # A poll has no body; reading one would let a client hold the thread.
            self._respond(conn, 400, b"a request body is not accepted\n", "text/plain", True)
            return
        if method not in (b"GET", b"HEAD"):
            self._respond(conn, 405, b"only GET and HEAD\n", "text/plain", close=True)
            return
        path = target.split(b"?", 1)[0].decode("latin-1")
        try:
            status, body, ctype, extra = conn.route(path)
        except Exception:
            log.exception("%s: route failed for %s", self.name, path)
            status, body, ctype, extra = 500, b"internal error\n", "text/plain", b""
        self._respond(conn, status, body, ctype, close, method == b"HEAD", extra)

    def _respond(
        self,
        conn: _Conn,
        status: int,
        body: bytes,
        ctype: str,
        close: bool = False,
        head_only: bool = False,
        extra: bytes = b"",
    ) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1
        key = (status, ctype, close)
        start = self._heads.get(key)
        if start is None:
            start = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: {ctype}\r\n"
                + ("Connection: close\r\n" if close else "")
                + "Content-Length: "
            ).encode("latin-1")
            if len(self._heads) < 64:
                self._heads[key] = start
        head = b"%s%d\r\n%s\r\n" % (start, len(body), extra)
        out = head if head_only else head + body
        conn.out = conn.out + out if conn.out else out
        conn.close_after = conn.close_after or close

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
            if not conn.out_since:
                conn.out_since = now
                self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return
        if conn.out_since:
            conn.out_since = 0.0
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        if conn.close_after:
            self._close(conn, None)

    def _close(self, conn: _Conn, reason: str | None) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        if reason is not None:
            self.closed[reason] = self.closed.get(reason, 0) + 1
        self._conns.pop(fd, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
