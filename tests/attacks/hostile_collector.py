"""A hostile OTLP collector on loopback (issue 43, item 1): answers that a client reading
them whole, or decompressing them, or waiting on them read by read, does not survive.
Used by tests/daemon/test_otlp_hostile.py and `kvsidecar bench otlp --hostile`."""

from __future__ import annotations

import functools
import socket
import socketserver
import threading
import time
import zlib

BIG = 300 * 2**20  # the figures: a 300 MB answer, or that much behind gzip


@functools.cache
def gzip_bomb(size: int = BIG) -> bytes:
    """``size`` zero bytes, gzipped (about 1/1000 of it on the wire)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    chunk = bytes(2**20)
    parts = [z.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, z.flush()])


class HostileCollector:
    """A loopback HTTP server answering each POST with what a hostile or broken collector
    could send. ``mode``: "big" (200 and a 300 MB body), "bomb" (200, Content-Encoding:
    gzip, 300 MB of zeros behind 300 KB), "trickle" (the status line and headers one byte
    every 0.5 s, for ever), "trickle-body" (200 and headers at once, then the body one
    byte every 0.5 s). Setting ``healthy`` makes later requests get a plain 200; each
    request's body is kept in ``bodies`` then."""

    def __init__(self, mode: str) -> None:
        self.mode, self.healthy = mode, threading.Event()
        self.requests = 0  # requests whose head and body arrived
        self.bodies: list[bytes] = []
        self._closed = threading.Event()
        serve = self._serve

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                serve(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            f = conn.makefile("rb")
            while not self._closed.is_set():
                try:
                    body = _read_request(f)
                except (OSError, ValueError):
                    return
                if body is None:
                    return
                self.requests += 1
                try:
                    if self.healthy.is_set():
                        self.bodies.append(body)
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                        continue
                    self._answer(conn)
                except OSError:
                    return  # the client gave up on the answer: what it should do
                return

    def _answer(self, conn: socket.socket) -> None:
        ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
        if self.mode == "big":
            conn.sendall(ok + b"Content-Length: %d\r\n\r\n" % BIG)
            chunk = bytes(2**20)
            for _ in range(BIG // len(chunk)):
                conn.sendall(chunk)
        elif self.mode == "bomb":
            bomb = gzip_bomb()
            conn.sendall(ok + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb))
            conn.sendall(bomb)
        elif self.mode in ("trickle", "trickle-body"):
            head = ok + b"Content-Length: 1000000\r\n\r\n"
            if self.mode == "trickle-body":
                conn.sendall(head)
            payload = head if self.mode == "trickle" else bytes(1_000_000)
            for i in range(len(payload)):
                if self._closed.wait(0.5):
                    return
                conn.sendall(payload[i : i + 1])
        time.sleep(1.0)  # let the client read before the close

    def close(self) -> None:
        self._closed.set()
        self.server.shutdown()
        self.server.server_close()


def _read_request(f) -> bytes | None:
    """One HTTP/1.1 request with a Content-Length body; None at EOF."""
    line = f.readline(65537)
    if not line:
        return None
    length = 0
    while True:
        h = f.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return f.read(length)
