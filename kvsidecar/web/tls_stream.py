"""Server-side TLS over an asyncio stream, on `ssl.MemoryBIO`: no thread per handshake.

Not asyncio's own ``start_tls``: on a failed handshake it closes without sending the
alert OpenSSL produced, so a client below ``min_version`` would see a bare EOF instead
of "protocol version". Here every byte OpenSSL wants to send is flushed first.
The CPU of the handshake can run elsewhere (``step``, a thread in the server).
Reads are pulled on demand, so a client can never make the daemon buffer more than
one TLS record beyond what a request head needs, and OpenSSL's state is only created
once the ClientHello is complete.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["Step", "TLSReader", "TLSWriter", "client_random", "handshake"]

_CHUNK = 65536
# Ciphertext moves through OpenSSL's memory BIOs this much at a time: a memory BIO keeps
# the capacity of the largest write for the connection's life (one per connection each
# way), so 64 KB pieces left ~16-64 KB per idle connection behind; 4 KB pieces cost a
# few more calls per request and keep at most ~4 KB each way.
_BIO_PIECE = 4096


class _TLS:
    def __init__(
        self, ctx: ssl.SSLContext, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.raw_reader, self.raw_writer = reader, writer

    def flush(self) -> None:
        data = self.outgoing.read()
        if data and not self.raw_writer.transport.is_closing():
            self.raw_writer.write(data)

    async def feed(self) -> bool:
        """More ciphertext from the peer; False at EOF."""
        self.flush()
        data = await self.raw_reader.read(_BIO_PIECE)
        if not data:
            self.incoming.write_eof()
            return False
        self.incoming.write(data)
        return True


# The first five bytes of a plain HTTP request (what Go's net/http checks), and its reply:
# an empty reply left curl and browsers guessing (exporter-toolkit answers the same 400).
_PLAIN_HTTP = frozenset({b"GET /", b"HEAD ", b"POST ", b"PUT /", b"OPTIO"})
_PLAIN_HTTP_REPLY = (
    b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
)


async def _plain_http(writer: asyncio.StreamWriter) -> None:
    writer.write(_PLAIN_HTTP_REPLY)
    try:
        await writer.drain()
    except OSError:
        pass
    writer.close()


Step = Callable[[Callable[[], None]], Awaitable[None]]
"""Runs one ``do_handshake`` call: the CPU of the handshake (an RSA signature is
milliseconds) happens there, e.g. on a thread, so the caller's loop keeps answering."""


async def _inline(fn: Callable[[], None]) -> None:
    fn()


def client_random(record: bytes) -> bytes:
    """The 32-byte random of a ClientHello record (b"" if it is not one): a fresh one per
    real client, so a repeat means a replayed hello."""
    # 5 bytes of record header, 4 of handshake header, 2 of client_version.
    if len(record) < 43 or record[0] != 0x16 or record[5] != 0x01:
        return b""
    return record[11:43]


async def handshake(
    ctx: ssl.SSLContext,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    step: Step = _inline,
    admit: Callable[[bytes], bool] = lambda hello: True,
) -> tuple[TLSReader, TLSWriter]:
    """The server handshake (the caller bounds it in time). ``admit`` sees the first
    record before OpenSSL does (False: closed, no crypto spent); ``step`` runs each
    ``do_handshake``. Raises `ssl.SSLError` (the alert already sent) or
    `ConnectionError` when the peer leaves or is not admitted."""
    # OpenSSL allocates tens of KB per connection once it starts reading: hold the
    # connection on the raw stream until the client's first record (the ClientHello,
    # at most 16 KB) has arrived whole, so a client trickling it costs only its bytes.
    try:
        header = await reader.readexactly(5)
        length = int.from_bytes(header[3:5], "big")
        whole = header[0] == 0x16 and length <= 16384 + 2048  # a handshake record, sane size
        first = header + (await reader.readexactly(length) if whole else b"")
    except asyncio.IncompleteReadError as e:
        if e.partial[:5] in _PLAIN_HTTP:  # "GET /\r\n" and the like: shorter than a record
            await _plain_http(writer)
        raise ConnectionResetError("client closed during the TLS handshake") from None
    if header in _PLAIN_HTTP:
        await _plain_http(writer)
        raise ssl.SSLError("plain HTTP request to the HTTPS port (answered 400)")
    if not admit(first):
        raise ConnectionRefusedError("TLS client hello not admitted")
    tls = _TLS(ctx, reader, writer)
    tls.incoming.write(first)  # anything else: OpenSSL refuses it with an alert
    while True:
        try:
            await step(tls.obj.do_handshake)
            break
        except ssl.SSLWantReadError:
            if not await tls.feed():
                raise ConnectionResetError("client closed during the TLS handshake") from None
        except ssl.SSLError:
            tls.flush()  # the alert
            writer.close()
            raise
    tls.flush()
    return TLSReader(tls), TLSWriter(tls)


class TLSReader:
    """The subset of `asyncio.StreamReader` the HTTP layer uses, over TLS."""

    def __init__(self, tls: _TLS, limit: int = _CHUNK) -> None:
        self._tls = tls
        self._buf = bytearray()
        self.limit = limit

    @property
    def raw(self) -> asyncio.StreamReader:
        """The ciphertext stream: where a hang-up shows."""
        return self._tls.raw_reader

    async def _fill(self) -> bool:
        while True:
            try:
                chunk = self._tls.obj.read(_CHUNK)
            except ssl.SSLWantReadError:
                if not await self._tls.feed():
                    return False
                continue
            except ssl.SSLZeroReturnError:  # close_notify
                return False
            if not chunk:
                return False
            self._buf += chunk
            return True

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        start = 0
        while True:
            i = self._buf.find(separator, start)
            if i >= 0:
                line = bytes(self._buf[: i + len(separator)])
                del self._buf[: i + len(separator)]
                return line
            if len(self._buf) > self.limit:
                raise asyncio.LimitOverrunError("separator not found within the limit", 0)
            start = max(0, len(self._buf) - len(separator) + 1)
            if not await self._fill():
                partial = bytes(self._buf)
                self._buf.clear()
                raise asyncio.IncompleteReadError(partial, None)

    async def read(self, n: int = -1) -> bytes:
        if not self._buf and not await self._fill():
            return b""
        size = len(self._buf) if n < 0 else n
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data


class TLSWriter:
    """The subset of `asyncio.StreamWriter` the HTTP layer uses, over TLS."""

    def __init__(self, tls: _TLS) -> None:
        self._tls = tls
        self.transport = tls.raw_writer.transport

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for i in range(0, len(view), _BIO_PIECE):
            self._tls.obj.write(view[i : i + _BIO_PIECE])
            self._tls.flush()

    async def drain(self) -> None:
        await self._tls.raw_writer.drain()

    def can_write_eof(self) -> bool:
        return False  # TLS has close_notify, not a half-close

    def write_eof(self) -> None:
        raise RuntimeError("TLS streams cannot half-close")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peercert":
            return self._tls.obj.getpeercert()
        return self._tls.raw_writer.get_extra_info(name, default)

    def close(self) -> None:
        try:
            self._tls.obj.unwrap()  # queues close_notify; the peer's reply is not awaited
        except (ssl.SSLError, ValueError):
            pass
        self._tls.flush()
        self._tls.raw_writer.close()
