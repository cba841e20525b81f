"""TLS for `kvsidecar.web.poll_server.PollServer` (the gateway listeners): optional, from a
web config file of its own (``--gateway.web-config-file``), in exporter-toolkit's format.

An endpoint picker's ``metrics-data-source`` speaks ``https`` with a CA and, optionally, a
client certificate; nothing else of the web config applies to it (it sends no basic auth), so
the gateway's file may hold only ``tls_server_config``: a file with ``basic_auth_users``,
``rate_limit`` or ``http_server_config`` is refused, rather than read as a protection the
gateway does not give. The file and the certificates it names are re-read as the main port's
are (`kvsidecar.web.live_config.LiveConfig`: on change, checked once a second, and on SIGHUP;
a broken new version is logged and the last good one stays in force); a new context applies
to the connections accepted after it.

The server stays a selector loop: `TLSSocket` wraps an accepted socket with
``do_handshake_on_connect=False`` and drives the handshake from its read events, raising
`BlockingIOError` where OpenSSL wants more bytes, so the server's recv/send paths stay those of
a plain socket. The handshake is bounded by the server's first-byte deadline (until a
request is decrypted the connection has sent no byte the server sees: handshake and first
request within ``head_timeout`` of the accept), and an unfinished one holds a place in the
same connection budget, among the first evicted (it has completed no request).
"""

from __future__ import annotations

import logging
import socket
import ssl

from kvsidecar.web.config import WebConfig, WebConfigError
from kvsidecar.web.config_file import load_web_config
from kvsidecar.web.live_config import LiveConfig
from kvsidecar.web.tls_context import peer_san_allowed

__all__ = ["PollTLS", "TLSSocket", "check_gateway_web_config"]

log = logging.getLogger(__name__)

FLAG = "--gateway.web-config-file"


def check_gateway_web_config(cfg: WebConfig) -> None:
    """Refuse what the gateway would not enforce; require the TLS it exists for."""
    where = cfg.path or FLAG
    extra = [
        key
        for key, present in (
            ("basic_auth_users", bool(cfg.basic_auth_users)),
            ("rate_limit", cfg.rate_limit is not None),
            ("http_server_config", bool(cfg.http.headers)),
        )
        if present
    ]
    if extra:
        raise WebConfigError(
            f"{where}: {FLAG} reads only tls_server_config, not {', '.join(extra)} (an "
            "endpoint picker sends no basic auth): give the gateway a file of its own"
        )
    if cfg.tls is None:
        raise WebConfigError(f"{where}: {FLAG} needs a tls_server_config (it is only for TLS)")


class PollTLS:
    """The gateway's TLS in force: a context per accepted connection, reloaded on change."""

    def __init__(self, cfg: WebConfig, check_interval_s: float = 1.0) -> None:
        check_gateway_web_config(cfg)
        self.live = LiveConfig(cfg, check_interval_s, check=check_gateway_web_config)
        self.refused_san = 0  # verified client certificates without an allowed SAN

    @classmethod
    def load(cls, path: str, check_interval_s: float = 1.0) -> PollTLS:
        return cls(load_web_config(path), check_interval_s)

    def reload(self) -> bool:
        """Re-read the file now (SIGHUP); False if the new version is invalid."""
        return self.live.reload()

    def wrap(self, sock: socket.socket) -> TLSSocket:
        """`sock` (accepted, non-blocking) as a server-side TLS socket, handshake pending."""
        state = self.live.current()
        assert state.ssl_context is not None and state.cfg is not None and state.cfg.tls
        tls = state.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return TLSSocket(tls, state.cfg.tls.client_allowed_sans, self)


class TLSSocket:
    """A non-blocking server-side `ssl.SSLSocket` that reads like a plain socket: the
    handshake runs inside `recv`, and "OpenSSL wants more" is `BlockingIOError`."""

    __slots__ = ("_allowed", "_owner", "_sock", "handshaken")

    def __init__(self, sock: ssl.SSLSocket, allowed: tuple[str, ...], owner: PollTLS) -> None:
        self._sock = sock
        self._allowed = allowed
        self._owner = owner
        self.handshaken = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def _handshake(self) -> None:
        try:
            self._sock.do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            # A want-write is retried on the next read event (the client reads our flight
            # first); the head deadline bounds a handshake that never ends either way.
            raise BlockingIOError from None
        if self._allowed and not peer_san_allowed(self._sock.getpeercert(), self._allowed):
            self._owner.refused_san += 1
            raise ConnectionRefusedError("client certificate SAN not in client_allowed_sans")
        self.handshaken = True

    def recv(self, n: int) -> bytes:
        if not self.handshaken:
            self._handshake()
        try:
            data = self._sock.recv(n)
            # Decrypted bytes OpenSSL already holds raise no read event: take them now.
            while data and self._sock.pending() and len(data) < 4 * n:
                data += self._sock.recv(self._sock.pending())
            return data
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None

    def send(self, data: bytes) -> int:
        if not self.handshaken:
            raise BlockingIOError  # nothing to send before a request, which needs the handshake
        try:
            return self._sock.send(data)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
