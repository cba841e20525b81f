"""A real OTLP/HTTP receiver on loopback, decoding with opentelemetry-proto."""

from __future__ import annotations

import gzip
import http.server
import socket
import ssl
import threading

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)


def start_receiver(stall: threading.Event | None = None, tls: ssl.SSLContext | None = None):
    """(server, requests received); with ``stall``, each POST waits for it before answering;
    with ``tls``, over HTTPS. ``server.headers`` holds each request's headers and
    ``server.paths`` its path."""
    got: list[ExportMetricsServiceRequest] = []
    headers: list[dict[str, str]] = []
    paths: list[str] = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers.append({k.lower(): v for k, v in self.headers.items()})
            paths.append(self.path)
            if stall is not None:
                stall.wait()
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            got.append(ExportMetricsServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.headers = headers  # type: ignore[attr-defined]
    srv.paths = paths  # type: ignore[attr-defined]
    if tls is not None:  # a failed handshake is an OSError at accept: the server goes on
        srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, got


class StalledReceiver:
    """Accepts TCP connections on loopback and never answers (nor reads): a hung collector."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connections are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
