"""A real OTLP/HTTP receiver on loopback, decoding with opentelemetry-proto."""

from __future__ import annotations

import http.server
import threading

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)


def start_receiver(stall: threading.Event | None = None):
    """(server, requests received); with ``stall``, each POST waits for it before answering."""
    got: list[ExportMetricsServiceRequest] = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if stall is not None:
                stall.wait()
            got.append(ExportMetricsServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, got
